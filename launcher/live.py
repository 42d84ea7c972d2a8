"""Whether a run is live: something launched under its directory may still read or write it. A launch must never
write into a live run (issue 39: a dry run once rewrote a running job's config and script under it, and bash, which
reads a script as it goes, then ran half a line of the new one). launch.make_plan asks here before anything is
written: a real launch of a live run is refused; a dry run renders into a fresh directory instead.

A run is live when
- its record (records.py) is a local launch whose launcher process is still running (record["pid"], written while
  the stages run and removed at the end; a pid the system has since given to a later process is not it), or
- its record is a Slurm launch with a stage Slurm still queues or runs (runs.stage_states asks squeue/sacct), or
- a trainer stage's results directory has a live RUNNING lock (runtime/io/run_lock.py): some other launch of the
  same directory, e.g. under another run name or started by hand, is training it.

Live or not, another run's directories are never written into (issue 57): `ownership_problems` below."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from launcher import records
from launcher.config import LaunchConfig
from launcher.errors import UserError
from launcher.job import Job
from launcher.stages import TRAINER_STAGES
from runtime.io import ownership
from runtime.schema.conversion import parse_conversion


@dataclass(frozen=True)
class Live:
    what: str   # what keeps it live, e.g. "its local launch (pid 4242) runs training"
    key: str    # the key a user would change to launch elsewhere


def recorded(base_results_dir: object, run_name: object) -> Live | None:
    """What keeps the run live by its record (its launcher, its Slurm jobs), or None."""
    if not isinstance(base_results_dir, str) or not isinstance(run_name, str) or not run_name:
        return None  # not a run directory yet: validate.py names the key
    run_dir = Path(base_results_dir) / run_name
    try:
        if not (run_dir / records.RECORD).exists():
            return None
    except OSError:
        return None  # a name the file system cannot hold: output_problems names it
    try:
        record = records.load(run_dir)
    except UserError:
        return None  # a damaged record: `status` names it; it keeps no job alive by itself
    if record.get("remote"):
        return None  # the head node's own record answers for it there
    if record["executor"] == "local":
        from launcher.runs import launch_running

        if not launch_running(record):  # its pid, and that pid is still the launch (its start time)
            return None
        from launcher.runs import stage_states

        running = [entry["stage"] for entry, state in stage_states(record) if state.state == "RUNNING"]
        doing = f" runs {running[0]}" if running else ""
        return Live(f"its local launch (pid {record['pid']}, since {record['created']}){doing}", "run_name")
    from launcher.runs import _ACTIVE, stage_states
    from launcher.slurm import SlurmError

    try:
        states = stage_states(record)
    except SlurmError as error:  # Slurm cannot be asked from here: its jobs may still run, so never write into it
        return Live(f"its Slurm jobs {', '.join(str(e['job_id']) for e in record['stages'])} may still run, and "
                    f"Slurm cannot be asked from here: {error}", "run_name")
    active = [f"{entry['stage']} (Slurm job {entry['job_id']}, {state.state})" for entry, state in states
              if state.state in _ACTIVE]
    return Live(f"Slurm still has {', '.join(active)}", "run_name") if active else None


def locked(jobs: list[Job]) -> Live | None:
    """A trainer stage's results directory that a live training holds (its RUNNING lock), or None."""
    from runtime.io import run_lock

    for job in jobs:
        if job.stage in TRAINER_STAGES and (holder := run_lock.holder(job.results_dir)) is not None:
            return Live(f"{job.results_dir} is being trained by {run_lock.describe(holder)}",
                        f"{job.stage}.run.results_dir")
    return None


def refusal(run_name: str, live: Live) -> str:
    return (f"{live.key}: run {run_name} is live ({live.what}); launching it again would write into the files it is "
            f"reading: wait for it (nxdt-launch status {run_name}), stop it (nxdt-launch cancel {run_name}), or "
            f"launch under another name, e.g. {live.key}={run_name}_2" if live.key == "run_name" else
            f"{live.key}: {live.what}; launching it again would have two writers of one run: wait for it to "
            f"finish or stop it (nxdt-launch cancel), or give another results directory")


# ---- Another run's directories ------------------------------------------------------------------------------
# Live or not, a run's directories are its own (runtime/io/ownership.py has the rule and the records): what a launch
# would resume from, write into, prune or replace, by the keys that name it, asked before anything is written; the
# directories it writes into are recorded as its own once it holds the run's launch lock (launch._claim).

@dataclass(frozen=True)
class Target:
    key: str        # the key that names the directory
    path: Path
    would: str      # what this launch would do there
    fix: str        # what to set instead, when another run owns it
    claim: bool     # recorded as this run's when the launch is written (a directory it writes into)


def targets(config: LaunchConfig, jobs: list[Job]) -> list[Target]:
    """Every local directory this launch would resume from, write into or prune, as its keys name it."""
    run_dir = config.run_dir
    found = [Target("base_results_dir", run_dir, "write its run directory inside it",
                    "give base_results_dir a directory outside that run's, e.g. base_results_dir=/fsx/results", True)]
    for job in jobs:
        key = f"{job.stage}.run.results_dir"
        found.append(Target(key, job.results_dir, "write its stage files there",
                            f"give it a directory of its own, e.g. {key}={run_dir}/{job.stage}", True))
        if job.stage in TRAINER_STAGES:
            dirpath = config.stage(job.stage).inputs.checkpoint_dir
            if ownership.local(dirpath):
                key = f"{job.stage}.exp_manager.checkpoint_callback_params.dirpath"
                fix = ownership.checkpoints_fix(f"{job.stage}.", dirpath, job.results_dir / "checkpoints")
                found.append(Target(key, Path(str(dirpath)), ownership.CHECKPOINTS_WOULD, fix, True))
        elif job.stage == "conversion" and (
                conversion := parse_conversion(config.stage(job.stage).section)[0]) is not None:
            if conversion.mode == "import" and ownership.local(conversion.checkpoint_dir):
                found.append(Target("conversion.checkpoint_dir", Path(conversion.checkpoint_dir),
                                    "write an imported checkpoint among its checkpoints",
                                    f"import into a directory of this run, e.g. conversion.checkpoint_dir="
                                    f"{run_dir}/imported", True))
            if conversion.mode == "export" and ownership.local(conversion.output_dir):
                found.append(Target("conversion.output_dir", Path(str(conversion.output_dir)),
                                    "write its export there", f"export into a directory of this run, e.g. "
                                    f"conversion.output_dir={job.results_dir}/hf_model", False))
    return found


def _export_inputs(section: dict[str, Any]) -> tuple[str, list[str]] | None:
    """An export with conversion.overwrite=true: its output_dir and the inputs replacing it must not delete."""
    conversion = parse_conversion(section)[0]
    if conversion is None or conversion.mode != "export" or not conversion.overwrite:
        return None
    source = conversion.checkpoint_dir
    if conversion.checkpoint_name and conversion.checkpoint_name != "latest":
        source = f"{source.rstrip('/')}/{conversion.checkpoint_name}"
    return str(conversion.output_dir), [source, *([conversion.tokenizer_model] if conversion.tokenizer_model else [])]


def ownership_problems(config: LaunchConfig, jobs: list[Job]) -> list[str]:
    """A directory this launch would resume from, write into or prune that another run owns (runtime/io/ownership.py),
    and an overwrite that would delete the stage's inputs or any run's checkpoints: one line each, before anything is
    written. Reading another run's checkpoints (an export, an evaluation, resume_from_checkpoint) is not refused."""
    mine = ownership.recorded_at(config.run_dir)
    found: dict[str, str] = {}  # one line per key, none for a directory inside one already refused
    refused: list[Path] = []
    for target in targets(config, jobs):
        path = Path(os.path.abspath(target.path))
        if target.key in found or any(path.is_relative_to(there) for there in refused):
            continue
        if problem := ownership.foreign(target.key, target.path, mine, target.would, target.fix):
            found[target.key] = problem
            refused.append(path)
    if "conversion" in config.stages and "conversion.output_dir" not in found and (
            export := _export_inputs(config.stage("conversion").section)):
        if problem := ownership.overwrite_problem("conversion.output_dir", *export):
            found["conversion.output_dir"] = problem
    return list(found.values())


# Held by a real launch from the moment it writes into the run directory until its process ends: two launches of
# one run started together both pass make_plan's look (neither has a record yet), and the one that comes second to
# this lock writes nothing (issue 57: the loser of that race once left its config link and script in the run).
LAUNCH_LOCK = ".launch.lock"


def hold_launch(run_dir: Path, run_name: str, made: list[Path]):
    """An open file holding an exclusive flock on `<run_dir>/.launch.lock` (closing it, or the process ending,
    releases it); UserError naming the other launch when one holds it. Creates run_dir if it is missing: the lock
    lives where every launch of the run, from any process on this host, looks. The lock file is appended to `made`
    when this launch created it, so that a launch refused under it leaves none behind: removing it while holding it
    is safe, as a launch that opened the old file before it went finds, once it holds that file's lock, that the
    name now leads elsewhere, and opens it again."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LAUNCH_LOCK
    while True:
        existed = os.path.lexists(path)
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read(200).strip() or "another nxdt-launch process"
            handle.close()
            raise UserError(f"run_name: run {run_name} is being launched by {holder} right now; this launch wrote "
                            f"nothing: wait for it (nxdt-launch status {run_name}) or launch under another name, e.g. "
                            f"run_name={run_name}_2") from None
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()  # the file was removed (by a refused launch) after this one opened it
    if not existed:
        made.append(path)
    return handle


def announce(handle) -> None:
    """Name this process in the lock file it holds (what a launch that finds it held shows): once the launch is
    accepted, so that a refused one changes nothing there."""
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} (since {datetime.now().isoformat(timespec='seconds')})\n")
    handle.flush()
