"""Sharded, async, resumable checkpoints that reshard on load (docs/checkpoints.md)."""
from runtime.checkpoint.loading import (full_tensors, load_checkpoint, ranged_full_tensors, read_config,
                                        read_rank_files)
from runtime.checkpoint.manager import (COMMIT, Checkpointer, Committed, committed_checkpoints, resolve_checkpoint,
                                        write_full_checkpoint)
from runtime.checkpoint.storage import open_storage

__all__ = ["COMMIT", "Checkpointer", "Committed", "committed_checkpoints", "full_tensors", "load_checkpoint",
           "open_storage", "ranged_full_tensors", "read_config", "read_rank_files", "resolve_checkpoint",
           "write_full_checkpoint"]
