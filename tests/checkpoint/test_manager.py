# The checkpoint manager's guarantees: only committed checkpoints are loaded, counted or kept; a crash in the middle
# of a write leaves the previous one as latest. (An async save writes what a sync save writes: test_streamed_save.py.)
import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from runtime.checkpoint import Checkpointer, committed_checkpoints, full_tensors, open_storage, read_rank_files
from runtime.checkpoint import resolve_checkpoint
from tests.checkpoint import crash_writer
from tests.checkpoint import harness as CH
from tests.runtime_parallel.dist_utils import run_distributed


def _save_steps(directory: str, steps: list[int], keep: int | None, token: str) -> None:
    cfg, topo, model, optimizer = CH.build("gpt", CH.L(), seed=1)
    ckpt = Checkpointer(directory, rank=dist.get_rank(), world_size=dist.get_world_size(), token=token,
                        keep_last=keep, async_save=True)
    for s in steps:
        ckpt.save(s, model, optimizer, topo, extra={"step": s}, config={})
    ckpt.wait()


def test_uncommitted_is_never_latest_and_retention_keeps_the_newest(tmp_path):
    run_distributed(_save_steps, world_size=1, args=(str(tmp_path), [1, 2], None, "a"))
    storage = open_storage(tmp_path)
    # A crashed save of a later launch: its files are there, its COMMIT is not.
    crashed = tmp_path / "step_00000003.b"
    crashed.mkdir()
    (crashed / "rank_00000.pt").hardlink_to(tmp_path / "step_00000002.a" / "rank_00000.pt")
    assert [c.step for c in committed_checkpoints(storage)] == [1, 2]
    assert resolve_checkpoint(str(tmp_path))[1].name == "step_00000002.a"
    with pytest.raises(ValueError, match="incomplete"):
        resolve_checkpoint(str(crashed))
    # The next launch keeps the newest 2 once its first save is committed, and sweeps the crashed leftover.
    run_distributed(_save_steps, world_size=1, args=(str(tmp_path), [4, 5], 2, "c"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004.c", "step_00000005.c"]


def _crash_writer(directory: str, stdout: int) -> None:
    """crash_writer.py's main, its stdout the pipe the test reads, on one thread as a torchrun worker."""
    torch.set_num_threads(1)  # first: the parent's OpenMP threads do not survive the fork (dist_utils.py)
    os.dup2(stdout, 1)
    sys.stdout = open(1, "w", closefd=False)
    crash_writer.main(directory)


@pytest.mark.slow
def test_kill_during_write_leaves_previous_checkpoint_latest(tmp_path):
    # The writer is a process forked from this one, where torch and the runtime are already imported (a fresh
    # interpreter would import them again): what is killed in the middle of a write is a process of its own.
    assert not dist.is_initialized(), "a forked process would inherit this process's group"
    read, write = os.pipe()
    proc = multiprocessing.get_context("fork").Process(target=_crash_writer, args=(str(tmp_path), write))
    proc.start()
    os.close(write)
    try:
        with os.fdopen(read) as stdout:
            assert stdout.readline().strip() == "committed step 1"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the spool file of step 2 exists and is being written
            spools = [p for p in tmp_path.glob("step_00000002.0/rank_00000.pt.tmp-*") if p.stat().st_size > 0]
            if spools:
                break
            time.sleep(0.002)
        assert spools, "the step-2 write was never seen in progress"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.join()
    storage = open_storage(tmp_path)
    assert [c.step for c in committed_checkpoints(storage)] == [1]
    _, latest = resolve_checkpoint(str(tmp_path))
    full = full_tensors(read_rank_files(storage, latest.name))
    assert latest.step == 1 and full.get("layers.0.mlp.fc1.weight", "value").abs().max() < 1.0  # step 1's weights
