"""`status`, `logs` and `cancel` over recorded launches (records.py). Slurm runs ask Slurm; local runs read
what the local executor recorded. A run launched on a remote head node is asked over SSH: `use_record`
picks the runner its record names, and every Slurm command and log read here goes through it."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from launcher import records, remote, slurm
from launcher.errors import UserError


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def use_record(record: dict[str, Any]):
    """The runner for this recorded run: SSH to the head node it was launched on, or this machine."""
    return remote.use(record.get("remote"))


def _exit_files(entry: dict[str, Any]) -> list[Path]:
    return [Path(p) for p in remote.current().glob(entry["log_dir"], f"{entry['stage']}_{entry['job_id']}_*.exit")]


def stage_states(record: dict[str, Any]) -> list[tuple[dict[str, Any], slurm.JobState]]:
    rows = []
    if record["executor"] == "slurm":
        for entry in record["stages"]:
            rows.append((entry, slurm.state(str(entry["job_id"]), _exit_files(entry))))
        return rows
    running = _pid_alive(record.get("pid"))
    waiting = False
    for entry in record["stages"]:
        code = entry.get("exit_code")
        if code is not None:
            rows.append((entry, slurm.JobState("COMPLETED") if code == 0 else slurm.JobState("FAILED", f"exit {code}")))
            waiting = waiting or code != 0
        elif running and not waiting:
            rows.append((entry, slurm.JobState("RUNNING")))
            waiting = True
        elif running:
            rows.append((entry, slurm.JobState("PENDING", "waits for the stage before it")))
        else:
            rows.append((entry, slurm.JobState("NOT RUN", "an earlier stage failed or the launch stopped")))
    return rows


def require_run(target: str, results_dir: Path) -> Path:
    run_dir = records.find_run(target, results_dir)
    if run_dir is None:
        known = ", ".join(p.name for p in records.all_runs(results_dir)) or "none"
        raise UserError(f"run {target!r}: no launch.json under {results_dir}; recorded runs: {known} "
                        "(use --results-dir to look elsewhere)")
    return run_dir


def log_files(record: dict[str, Any], stage: str | None) -> list[Path]:
    entries = [e for e in record["stages"] if stage in (None, e["stage"])]
    if stage and not entries:
        stages = ", ".join(e["stage"] for e in record["stages"])
        raise UserError(f"stage {stage!r} is not part of run {record['run_name']!r}; its stages: {stages}")
    files = []
    for entry in entries:
        log_dir = Path(entry["log_dir"])
        if record["executor"] == "local":
            files += [p for p in [log_dir / f"{entry['stage']}_local.log"] if p.exists()]
        else:  # listed by the runner: the directory may be on the remote head node
            found = remote.current().glob(str(log_dir), f"{entry['stage']}_{entry['job_id']}_*")
            files += [Path(p) for p in found if p.endswith((".out", ".log"))]
    return files


def cancel(record: dict[str, Any]) -> str:
    if record["executor"] == "slurm":
        ids = [str(e["job_id"]) for e in record["stages"] if e.get("job_id")]
        slurm.cancel(ids)
        return f"scancel {' '.join(ids)}"
    pid = record.get("pid")
    if not _pid_alive(pid):
        return "nothing to cancel: the local launch is not running"
    os.kill(pid, signal.SIGINT)  # the launcher stops its running stage and records the exit code
    return f"interrupted the local launch (pid {pid})"
