# A checkpoint of ours from full tensors with their optimizer state (runtime/convert/titan.py's from-titan): one rank
# file that any layout resumes from, moments, step and data position included. manager.write_full_checkpoint writes
# weights only; this is it with the optimizer's pieces, and belongs there once it takes them.
from __future__ import annotations

import json
import secrets
import time

import torch

from runtime.checkpoint.manager import FORMAT, COMMIT, _done_file, _put_config, _put_rank_file, _rank_file
from runtime.checkpoint.storage import open_storage


def _piece(tensor: torch.Tensor) -> dict:
    shape = tuple(tensor.shape)
    return {"dim": None, "index": None, "full_shape": shape, "shard_shape": shape, "start": 0}


def write_checkpoint(location: str, step: int, weights: dict[str, torch.Tensor], moments: dict[str, dict], *,
                     step_count: int, extra: dict, config: dict) -> str:
    """weights {name: full tensor}, moments {exp_avg|exp_avg_sq: {name: full tensor}} (empty: none), the optimizer's
    step count and `extra` (step, data position) -> a committed checkpoint under `location`; returns its path. It is
    committed last (COMMIT), and removed whole if writing fails."""
    storage = open_storage(location)
    name = f"step_{step:08d}.{secrets.token_hex(4)}"
    model = {n: [{**_piece(t), "value": t.detach().cpu().contiguous()}] for n, t in weights.items()}
    optim = {}
    if moments:
        optim = {n: [{**_piece(t), **{key: moments[key][n].detach().cpu().contiguous() for key in moments},
                      "master": None}] for n, t in weights.items()}
    layout = {"tp": 1, "pp": 1, "dp": 1, "zero1": False}
    try:
        digest = _put_rank_file(storage, f"{name}/{_rank_file(0)}", {
            "format": FORMAT, "rank": 0, "world_size": 1, "step": step, "layout": layout,
            "optim_scalars": {"step": step_count if moments else 0, "sr_generator": None, "optimizer": None},
            "extra": extra}, {"model": model, "optim": optim})
        _put_config(storage, name, config)
        storage.put_bytes(f"{name}/{_done_file(0)}", json.dumps(digest).encode())
        meta = {"format": FORMAT, "step": step, "world_size": 1, "layout": layout, "committed_at": time.time(),
                "source": "torchtitan", "files": {_rank_file(0): digest}}
        storage.put_bytes(f"{name}/{COMMIT}", json.dumps(meta, indent=1).encode())
    except BaseException:  # a full disk, say: no uncommitted directory is left for the next reader to skip
        storage.delete_prefix(name)
        raise
    return f"{storage.root}/{name}"
