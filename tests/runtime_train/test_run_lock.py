"""One writer per run (runtime/io/run_lock.py): a live holder is named and refused, a dead one's lock is taken
over, and a Slurm job's own earlier attempt (a requeue) takes its lock back. Real processes, real files."""
import json
import os
import subprocess
import sys
import time

import pytest

from runtime.io import run_lock

HOLD = """
import sys, time
from runtime.io import run_lock
run_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def _holder_process(run_dir):
    # The lock treats only a trainer as a live holder, so the holding process carries runtime.train in its argv.
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), "runtime.train"], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_refused_then_its_stale_lock_is_taken(tmp_path):
    proc = _holder_process(tmp_path)
    try:
        with pytest.raises(run_lock.RunLocked, match=f"is already being trained by pid {proc.pid} on "):
            run_lock.acquire(tmp_path)
        assert run_lock.holder(tmp_path)["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert run_lock.holder(tmp_path) is None, "a killed holder leaves a stale lock"
    run_lock.acquire(tmp_path)
    assert json.loads((tmp_path / "RUNNING").read_text())["pid"] == os.getpid()
    run_lock.release(tmp_path)
    assert not (tmp_path / "RUNNING").exists()


def test_a_requeued_slurm_job_takes_its_own_lock_back(tmp_path, monkeypatch):
    (tmp_path / "RUNNING").write_text(json.dumps({"host": "node7", "pid": 1, "slurm_job_id": "42",
                                                 "since": time.time()}))
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    monkeypatch.setattr(run_lock, "_slurm_job_running", lambda job: True)  # job 42 still runs elsewhere
    with pytest.raises(run_lock.RunLocked, match=r"pid 1 on node7 \(Slurm job 42\)"):
        run_lock.acquire(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    run_lock.acquire(tmp_path)


def test_a_recycled_pid_is_not_a_holder(tmp_path):
    import socket

    (tmp_path / "RUNNING").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                 "since": time.time()}))
    assert run_lock.holder(tmp_path) is None, "pytest is not a trainer"
