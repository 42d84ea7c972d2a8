# One writer per run. The training job holds `<results_dir>/RUNNING` while it trains: created atomically (so two
# launches racing for it cannot both win), naming the host, pid and Slurm job that hold it, removed on the way
# out. A lock whose holder is gone is stale and taken over: its pid is dead on this host, or its Slurm job is no
# longer running, or it is this very job's earlier attempt (a requeue or a torchrun restart). The launcher reads
# the same file to refuse a second launch and `status` shows it. Standard library only.
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

LOCK = "RUNNING"


def _holder_here() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": time.time()}


def describe(holder: dict) -> str:
    job = f" (Slurm job {holder['slurm_job_id']})" if holder.get("slurm_job_id") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}{job} since {since}"


def _slurm_job_running(job_id: str) -> bool | None:
    """Whether Slurm still runs (or queues) the job; None when Slurm cannot be asked from here."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False  # squeue errors out on a job id it no longer knows
    return out.stdout.strip() not in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _alive(holder: dict) -> bool:
    job = holder.get("slurm_job_id")
    if job and job == os.environ.get("SLURM_JOB_ID"):
        return False  # this job's own earlier attempt: requeued, or restarted by torchrun
    if holder.get("host") == socket.gethostname():
        try:
            pid = int(holder.get("pid", -1))
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, TypeError):
            return True
        try:  # a recycled pid is some other program, not a trainer
            return b"runtime.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return True
    if job:
        running = _slurm_job_running(job)
        if running is not None:
            return running
    return True  # another host, no way to ask: assume it is still training rather than risk two writers


def holder(run_dir: str | os.PathLike) -> dict | None:
    """Who trains this run now (the lock's content), or None when nobody does (no lock, or a stale one)."""
    try:
        found = json.loads((Path(run_dir) / LOCK).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and _alive(found) else None


class RunLocked(ValueError):
    """Another live process trains this run."""


def acquire(run_dir: str | os.PathLike) -> Path:
    """Take the run's lock for this process; RunLocked names the holder when a live one has it."""
    path = Path(run_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            current = holder(run_dir)
            if current is not None:
                raise RunLocked(f"{run_dir} is already being trained by {describe(current)}; wait for that run "
                                f"to finish or cancel it (nxdt-launch cancel) before launching it again") from None
            path.unlink(missing_ok=True)  # stale: its holder is gone
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(_holder_here(), f)
        return path
    raise RunLocked(f"{path}: could not take the run's lock (another launch keeps taking it); try again")


def release(run_dir: str | os.PathLike) -> None:
    """Remove the lock if this process holds it."""
    path = Path(run_dir) / LOCK
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if current.get("pid") == os.getpid() and current.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
