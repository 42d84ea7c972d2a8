# Launch the chosen candidates as short training runs through the launcher's own plan/write/submit steps, wait
# for them, and read what each measured (metrics.jsonl) or why it failed (its log and final state).
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from statistics import median
from typing import Any

from launcher import launch, records, runs, slurm
from launcher.autoconfig.search import Ranked
from launcher.errors import UserError
from runtime.io.files import json_lines

# Log lines that mean the device (or host) ran out of memory: CUDA, torch-xla/Neuron, Linux.
_RUNTIME_ERROR = re.compile(r"^error( \(rank \d+\))?: ")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception): ")
OOM_MARKERS = ("out of memory", "outofmemoryerror", "resource_exhausted", "cannot allocate memory", "oom-kill",
               "oom_kill", "failed to allocate")


@dataclasses.dataclass
class Trial:
    ranked: Ranked
    run_name: str
    overrides: list[str]
    plan: launch.Plan | None = None
    record: dict[str, Any] | None = None
    state: str = "PENDING"       # the final Slurm-style state: COMPLETED, FAILED, TIMEOUT, ...
    detail: str = ""             # Slurm's reason or the exit code

    @property
    def results_dir(self) -> Path:
        return self.plan.config.stage("training").results_dir


@dataclasses.dataclass(frozen=True)
class Measurement:
    trial: Trial
    ok: bool
    reason: str                  # empty when ok; OOM, time limit, the runtime's error line, or the exit state
    steps: int                   # logged steps the averages use
    step_time_s: float | None
    tokens_per_s: float | None
    tflops_per_device: float | None
    memory_gib: float | None


def submit(trials: list[Trial], *, produced_by: str) -> None:
    """Plan, write and (on Slurm) submit every trial; a trial whose plan the launcher refuses raises."""
    for trial in trials:
        trial.plan = launch.make_plan(trial.overrides, dry_run=False, produced_by=produced_by)
        scripts = launch.write(trial.plan)
        trial.record = launch.new_record(trial.plan, scripts)
        trial.record["scripts"] = [str(s) for s in scripts]
        if trial.plan.executor == "slurm":
            try:
                launch.submit_slurm(trial.plan, scripts, trial.record)
            except slurm.SlurmError as error:
                raise UserError(f"autoconfig: Slurm refused {trial.run_name}: {error}") from None


def wait_slurm(trials: list[Trial], *, deadline_s: float, poll_s: float = 2.0) -> None:
    """Poll until every trial's job has finished (its time limit bounds each); past the deadline, cancel the
    rest. UNKNOWN (left the queue, no accounting, no exit file yet) counts as finished after a grace period."""
    pending = [t for t in trials if t.plan.executor == "slurm"]
    unknown_since: dict[str, float] = {}
    started = time.monotonic()
    while pending:
        for trial in list(pending):
            (_, job_state), = runs.stage_states(trial.record)
            trial.state, trial.detail = job_state.state, job_state.reason
            if job_state.state == "UNKNOWN":
                first = unknown_since.setdefault(trial.run_name, time.monotonic())
                if time.monotonic() - first < 30:
                    continue
            if job_state.state in slurm.FINISHED or job_state.state == "UNKNOWN":
                pending.remove(trial)
        if pending and time.monotonic() - started > deadline_s:
            slurm.cancel([str(t.record["stages"][0]["job_id"]) for t in pending])
            for trial in pending:
                trial.state, trial.detail = "CANCELLED", "the search's overall time ran out"
            return
        if pending:
            time.sleep(poll_s)


def run_local(trial: Trial, *, timeout_s: float) -> None:
    """Run one trial's script on this machine (the local executor's way), stopping it at its time limit."""
    plan, record = trial.plan, trial.record
    records.archive_previous(plan.run_dir)
    record["pid"] = os.getpid()
    record["stages"][0]["job_id"] = "local"
    records.write(plan.run_dir, record)
    proc = subprocess.Popen(["bash", record["scripts"][0]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # the script logs to its stage log itself
    try:
        code = proc.wait(timeout=timeout_s)
        trial.state = "COMPLETED" if code == 0 else "FAILED"
        trial.detail = f"exit {code}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        trial.state, trial.detail = "TIMEOUT", f"stopped after {timeout_s / 60:g} minutes"
    record["stages"][0]["exit_code"] = code
    record.pop("pid", None)
    records.write(plan.run_dir, record)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Training records (the ones with a loss) of a metrics.jsonl; a torn last line is skipped."""
    if not path.exists():
        return []
    return [row for row in json_lines(path.read_text()) if "loss" in row and row.get("step_time_s")]


def _log_text(trial: Trial, limit: int = 20000) -> str:
    entry = trial.record["stages"][0]
    if trial.plan.executor == "local":
        files = [Path(entry["log_dir"]) / f"{entry['stage']}_local.log"]
    else:
        files = runs.log_files(trial.record, entry["stage"])
    return "\n".join(f.read_text(errors="replace")[-limit:] for f in files if f.exists())


def failure_reason(state: str, detail: str, log: str) -> str:
    """One short reason: OOM, time limit, the runtime's `error:` line, a worker's exception, or the final state."""
    lowered = log.lower()
    if state == "OUT_OF_MEMORY" or any(marker in lowered for marker in OOM_MARKERS):
        return "OOM"
    if state == "TIMEOUT":
        return f"time limit ({detail})" if detail and detail != "None" else "time limit"
    lines = [line.strip() for line in log.splitlines()]
    errors = [line for line in lines if _RUNTIME_ERROR.match(line)]  # the runtime's one-line user errors
    if errors:  # rank 0 says it without "(rank N)"
        return next((line for line in errors if line.startswith("error: ")), errors[0])[:300]
    # A worker's traceback ends in `SomeError: message`; torchrun's own ChildFailedError only says a worker died.
    raised = [line for line in lines if _EXCEPTION.match(line) and "ChildFailedError" not in line]
    if raised:
        return raised[0][:300]
    if "sigkill" in lowered or "signal 9" in lowered:
        return "killed (SIGKILL; out of host memory?)"
    return f"{state} ({detail})" if detail else state


def measure(trial: Trial) -> Measurement:
    """Medians over the logged steps after the first (which includes compilation and warm-up caches)."""
    rows = read_metrics(trial.results_dir / "metrics.jsonl")
    steady = [r for r in rows if r["step"] >= 2] or rows
    ok = trial.state == "COMPLETED" and bool(steady)
    reason = "" if ok else (failure_reason(trial.state, trial.detail, _log_text(trial)) if trial.state != "COMPLETED"
                            else "finished without logging a step")

    def middle(key: str) -> float | None:
        values = [float(r[key]) for r in steady if r.get(key) is not None]
        return median(values) if values else None

    memory = max((float(r["memory_gib"]) for r in steady if r.get("memory_gib") is not None), default=None)
    return Measurement(trial, ok, reason, len(steady), middle("step_time_s"), middle("tokens_per_s"),
                       middle("tflops_per_device"), memory)
