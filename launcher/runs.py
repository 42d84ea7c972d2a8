"""`status`, `logs` and `cancel` over recorded launches (records.py). Slurm runs ask Slurm; local runs read
what the local executor recorded. A run launched on a remote head node is asked over SSH: `use_record`
picks the runner its record names, and every Slurm command and log read here goes through it.

Cancelling a local run: the training's workers get SIGUSR1, which runtime/preemption.py turns into "finish this
step, save a checkpoint, exit 75"; the launcher that runs the pipeline sees the stage end and runs no more.
cancel.json (records.py) says the stop was asked for, so `status` shows CANCELLED rather than FAILED."""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from launcher import records, remote, run_index, slurm
from launcher.stages import TRAINER_STAGES
from launcher.errors import UserError
from runtime.io.files import json_lines
from runtime.schema.facts import PREEMPTED_EXIT_CODE

# Slurm states after which a job writes no more output (slurm.FINISHED, plus what `status` says when a job has
# left the queue and nothing else knows it). Anything else may still write.
_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
           "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED"}


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # an exited process its parent has not waited for yet (a zombie) still takes signal 0
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_started(pid: int) -> float | None:
    """When the process `pid` started, in seconds since the epoch (psutil: the same value each time it is asked);
    None when there is no such process or it cannot be asked."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def launch_running(record: dict[str, Any]) -> bool:
    """Whether the local launch this record names still runs: its pid is alive and is that launch, not a later
    process the system has given the pid to. The launch records its start time next to its pid (pid_started);
    a record from before that is the launch's only if the process started before the record was created."""
    pid = record.get("pid")
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    started = process_started(pid)
    if started is None:
        return False
    recorded = record.get("pid_started")
    if isinstance(recorded, (int, float)):
        return abs(started - recorded) < 0.5  # the kernel counts start times in ticks: the same process, same value
    try:
        return started <= datetime.fromisoformat(str(record.get("created"))).timestamp() + 1
    except ValueError:
        return False


def use_record(record: dict[str, Any]):
    """The runner for this recorded run: SSH to the head node it was launched on, or this machine."""
    return remote.use(record.get("remote"))


def _exit_files(entry: dict[str, Any]) -> list[Path]:
    return [Path(p) for p in remote.current().glob(entry["log_dir"], f"{entry['stage']}_{entry['job_id']}_*.exit")]


def _local_exit_file_code(entry: dict[str, Any], record: dict[str, Any]) -> int | None:
    """The code the stage's script wrote on exit, when the launcher that ran it stopped before recording it.
    A file older than this launch is an earlier launch's (the script overwrites it, never removes it)."""
    path = Path(entry["log_dir"]) / f"{entry['stage']}_local.exit"
    try:
        created = datetime.fromisoformat(str(record.get("created"))).timestamp()
        if path.stat().st_mtime + 1 < created:
            return None
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def stage_states(record: dict[str, Any]) -> list[tuple[dict[str, Any], slurm.JobState]]:
    rows = []
    if record["executor"] == "k8s":
        from launcher import k8s

        return k8s.stage_states(record, launch_running(record))
    if record["executor"] == "slurm":
        for entry in record["stages"]:
            rows.append((entry, slurm.state(str(entry["job_id"]), _exit_files(entry))))
        return rows
    running = launch_running(record)
    cancelled = set(record.get("cancelled") or [])
    waiting = False
    for entry in record["stages"]:
        code = entry.get("exit_code")
        if code is None and not running:  # the launcher stopped before recording it (the file says)
            code = _local_exit_file_code(entry, record)
        if code is not None:
            if entry["stage"] in cancelled and code != 0:
                # The training saved a checkpoint and stopped (runtime/preemption.py).
                how = "stopped at a checkpoint" if code == PREEMPTED_EXIT_CODE else f"exit {code}"
                rows.append((entry, slurm.JobState("CANCELLED", how)))
            elif code == 0:
                rows.append((entry, slurm.JobState("COMPLETED")))
            else:
                rows.append((entry, slurm.JobState("FAILED", f"exit {code}")))
            waiting = waiting or code != 0
        elif running and not waiting:
            rows.append((entry, slurm.JobState("RUNNING")))
            waiting = True
        elif running:
            rows.append((entry, slurm.JobState("PENDING", "waits for the stage before it")))
        elif cancelled:
            rows.append((entry, slurm.JobState("NOT RUN", "the run was cancelled")))
        else:
            rows.append((entry, slurm.JobState("NOT RUN", "an earlier stage failed or the launch stopped")))
    return rows


def require_run(target: str, results_dir: Path, *, use_index: bool = True) -> Path:
    """The run directory of `target`: a run directory, a run under `results_dir`, a remote run, or (unless the
    user named --results-dir) a run that the index knows under that name, wherever it was launched."""
    run_dir = records.find_run(target, results_dir)
    if run_dir is not None:
        return run_dir
    indexed = run_index.lookup(target) if use_index and "/" not in target else []
    if len(indexed) == 1:
        return indexed[0].resolve()
    if len(indexed) > 1:
        where = ", ".join(str(d.parent) for d in indexed)
        raise UserError(f"run {target!r} was launched under {len(indexed)} results directories: {where}; choose "
                        f"one with --results-dir, e.g. --results-dir {indexed[-1].parent}")
    known = sorted({p.name for p in records.all_runs(results_dir)}
                   | ({p.name for p in run_index.all_runs()} if use_index else set()))
    raise UserError(f"run {target!r}: no launch.json under {results_dir}{' or in the run index' if use_index else ''}"
                    f"; recorded runs: {', '.join(known) or 'none'} (use --results-dir to look elsewhere)")


def launch_of(run_dir: Path, record: dict[str, Any], stage: str | None) -> dict[str, Any]:
    """The record of the newest launch of the run that ran `stage`: this one, or an earlier launch's kept record
    (a stage-only launch, stages=[conversion], after a full one leaves the training's logs where they were)."""
    if stage is None or any(e["stage"] == stage for e in record["stages"]):
        return record
    found = next((r for r in records.earlier(run_dir) if any(e["stage"] == stage for e in r["stages"])), None)
    if found is None:
        _entries(record, stage, launched=_launched(run_dir, record))  # raises: the stages the run ever ran
    return found


def _launched(run_dir: Path, record: dict[str, Any]) -> list[str]:
    """Every stage the run has launched, this launch's first."""
    names = [e["stage"] for r in [record, *records.earlier(run_dir)] for e in r["stages"]]
    return list(dict.fromkeys(names))


def every_log_file(run_dir: Path, record: dict[str, Any]) -> list[Path]:
    """The logs of every stage the run has launched: this launch's stages, then those only earlier launches ran."""
    return [path for stage in _launched(run_dir, record)
            for path in log_files(launch_of(run_dir, record, stage), stage)]


def log_files(record: dict[str, Any], stage: str | None) -> list[Path]:
    files = []
    for entry in _entries(record, stage):
        log_dir = Path(entry["log_dir"])
        if record["executor"] == "local":
            files += [p for p in [log_dir / f"{entry['stage']}_local.log"] if p.exists()]
        else:  # listed by the runner: the directory may be on the remote head node
            found = remote.current().glob(str(log_dir), f"{entry['stage']}_{entry['job_id']}_*")
            files += [Path(p) for p in found if p.endswith((".out", ".log"))]
    return files


def _entries(record: dict[str, Any], stage: str | None, launched: list[str] | None = None) -> list[dict[str, Any]]:
    entries = [e for e in record["stages"] if stage in (None, e["stage"])]
    if stage and not entries:
        stages = ", ".join(launched or [e["stage"] for e in record["stages"]])
        raise UserError(f"stage {stage!r} is not part of run {record['run_name']!r}; its stages: {stages}")
    return entries


def ended(record: dict[str, Any], stage: str | None) -> bool:
    """Whether `stage` (or every stage) of this run will write no more output."""
    states = dict((e["stage"], s.state) for e, s in stage_states(record))
    return all(states[e["stage"]] not in _ACTIVE for e in _entries(record, stage))


class _Tail:
    """The part of one log file not printed yet. Local files are read from where the last read stopped (a
    training log grows to many MB); a file on a remote head node is read whole over SFTP and cut."""

    def __init__(self, path: Path, local: bool):
        self.path, self.local, self.offset = path, local, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split by a read

    def read_new(self) -> str:
        if not self.local:
            text = remote.current().read_text(str(self.path))
            new, self.offset = text[self.offset:], len(text)
            return new
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        self.offset += len(data)
        return self._decoder.decode(data)


def follow(run_dir: Path, record: dict[str, Any], stage: str | None, write: Callable[[str], None],
           poll_s: float | None = None) -> None:
    """Print the logs of `stage` (or all stages) as they grow, until that stage has ended and its output is
    printed whole. Stages that start later are picked up as their logs appear."""
    local = not record.get("remote")  # the logs are files here (a k8s run's on the shared volume)
    poll_s = poll_s if poll_s is not None else (0.5 if local and record["executor"] == "local" else 5.0)  # Slurm,
    # the API server and SSH cost more to ask
    tails: dict[Path, _Tail] = {}
    shown: Path | None = None
    while True:
        # Asked before reading, so that what is read after it has ended is everything the stage wrote.
        done = ended(record, stage)
        for path in log_files(record, stage):
            tail = tails.setdefault(path, _Tail(path, local))
            text = tail.read_new()
            if not text:
                continue
            if shown != path and (len(tails) > 1 or stage is None):
                write(f"{'' if shown is None else chr(10)}==> {path} <==\n")
            shown = path
            write(text)
        if done:
            return
        time.sleep(poll_s)
        record = records.load(run_dir)


def cancel(record: dict[str, Any], run_dir: Path, *, timeout_s: float) -> str:
    if record["executor"] == "slurm":
        ids = [str(e["job_id"]) for e in record["stages"] if e.get("job_id")]
        slurm.cancel(ids)
        return f"scancel {' '.join(ids)}"
    if record["executor"] == "k8s":
        from launcher import k8s

        return k8s.cancel(record, run_dir)
    return _cancel_local(run_dir, record, timeout_s=timeout_s)


# --- cancelling a local run ---------------------------------------------------------------------------------
# The processes of a running local stage: the launcher (record["pid"]) -> `bash <stage>.local.sh`, a session of
# its own -> `python -m runtime.torchrun` -> one worker per device, each in a session of its own (torchrun
# starts them so). Signalling the script's process group would reach neither the workers nor only them: bash and
# tee would die of USR1, and torchrun (not told to handle USR1 in a local script) too, leaving the workers alone.

TERM_GRACE_S = 30  # after TERM: torchrun stops its workers, and kills them after its own shutdown timeout


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process of this machine (`ps`: Linux and macOS alike)."""
    result = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "args="], capture_output=True,
                            text=True, timeout=30)
    table = {}
    for line in result.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), parts[2] if len(parts) > 2 else "")
    return table


def _stage_process(table: dict[int, tuple[int, str]], launcher_pid: int, entry: dict[str, Any]) -> int | None:
    """The script the launcher runs for this stage (its pid leads the stage's process group)."""
    if table.get(entry.get("pid"), (None,))[0] == launcher_pid:  # a pid the system gave to another is not it
        return entry["pid"]
    return next((pid for pid, (parent, args) in table.items() if parent == launcher_pid and entry["script"] in args),
                None)


def _workers(table: dict[int, tuple[int, str]], stage_pid: int) -> list[int]:
    """The children of the stage's runtime.torchrun: the processes that run the training loop."""
    below, found = [stage_pid], []
    while below:
        pid = below.pop()
        children = [child for child, (parent, _) in table.items() if parent == pid]
        if "runtime.torchrun" in table.get(pid, (0, ""))[1]:
            found += children
        else:
            below += children
    return found


def _catches_usr1(pid: int) -> bool:
    """Whether the worker has set its USR1 handler yet (runtime/preemption.py sets it once the model is built):
    before that, USR1 would kill it. Where /proc cannot tell, assume it has."""
    try:
        caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return True
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))


def _signal(pid: int, signum: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except OSError:
        pass  # it has just ended: what we wanted


def _cancel_local(run_dir: Path, record: dict[str, Any], *, timeout_s: float) -> str:
    """Ask the running stage to stop (a training: save and stop; any other stage: TERM), wait for the launcher to
    stop with it, and TERM whatever still runs after `timeout_s`."""
    launch = {key: record.get(key) for key in ("pid", "pid_started", "created")}  # the record drops pid at the end
    launcher_pid = launch["pid"]
    if not launch_running(launch):
        reused = (f"; its pid {launcher_pid} now belongs to another process, which is left alone"
                  if isinstance(launcher_pid, int) and pid_alive(launcher_pid) else "")
        return f"nothing to cancel: the local launch is not running{reused}"
    asked: dict[str, str] = {}   # stage -> what it was sent
    usr1_sent: set[int] = set()
    deadline, termed = time.monotonic() + timeout_s, False
    while launch_running(launch) and not (termed and time.monotonic() > deadline):
        record = records.load(run_dir)
        entry = next((e for e, state in stage_states(record) if state.state == "RUNNING"), None)
        table = _processes() if entry is not None else {}
        stage_pid = _stage_process(table, launcher_pid, entry) if entry is not None else None
        if stage_pid is not None:
            name = entry["stage"]
            if name not in asked:  # noted before the signal, so that its exit code already reads as cancelled
                asked[name] = ("SIGUSR1 to its workers (save a checkpoint, stop)" if name in TRAINER_STAGES
                              else "SIGTERM")
                records.write_cancel(run_dir, record, list(asked), "; ".join(f"{k}: {v}" for k, v in asked.items()))
                if name not in TRAINER_STAGES:
                    _signal(stage_pid, signal.SIGTERM, group=True)
            if name in TRAINER_STAGES and not termed:
                for worker in _workers(table, stage_pid):
                    if worker not in usr1_sent and _catches_usr1(worker):
                        _signal(worker, signal.SIGUSR1)
                        usr1_sent.add(worker)
            if not termed and time.monotonic() > deadline:
                _signal(stage_pid, signal.SIGTERM, group=True)
        if not termed and time.monotonic() > deadline:
            termed, deadline = True, time.monotonic() + TERM_GRACE_S
        time.sleep(0.2)
    record = records.load(run_dir)
    lines = [f"{entry['stage']}: {state}" for entry, state in stage_states(record)]
    if launch_running(launch):  # still this launch: never another process that has its pid
        lines.append(f"the launch (pid {launcher_pid}) is still running {TERM_GRACE_S} s after SIGTERM; "
                     f"stop it with: kill {launcher_pid}")
    elif not asked:
        lines.insert(0, "the launch ended before any stage was asked to stop")
    else:
        lines.insert(0, f"cancelled run {record['run_name']!r}: " + "; ".join(f"{k}: {v}" for k, v in asked.items())
                     + (f"; SIGTERM after {timeout_s:g} s" if termed else ""))
    return "\n".join(lines)


# --- progress of a running training ---------------------------------------------------------------------------

def training_progress(entry: dict[str, Any], *, window: int = 5) -> str | None:
    """`step 120 of 1000 (12%), loss 3.4121, about 4m 10s left`, from the training's metrics.jsonl (rows of
    step, loss and the mean step_time_s since the row before) and trainer.max_steps in its stage config."""
    import yaml

    runner = remote.current()
    metrics = str(Path(entry["log_dir"]).parent / "metrics.jsonl")
    try:
        rows = [r for r in json_lines(runner.read_text(metrics)) if {"step", "loss", "step_time_s"} <= r.keys()]
        max_steps = int(yaml.safe_load(runner.read_text(str(entry["config"])))["trainer"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    if not rows:
        return None
    last = rows[-1]
    step = int(last["step"])
    recent = [float(r["step_time_s"]) for r in rows[-window:]]
    left_s = max(max_steps - step, 0) * sum(recent) / len(recent)
    memory = ""
    if isinstance(last.get("host_peak_gib"), (int, float)) and isinstance(last.get("node_host_peak_gib"), (int, float)):
        # The runtime's memory_peaks (runtime/train.py): how close the run is to a node's memory.
        memory = (f"; host memory peak {last['host_peak_gib']:.2f} GiB (rank {last.get('host_peak_rank', '?')}), "
                  f"{last['node_host_peak_gib']:.1f} GiB on the busiest node")
        if isinstance(last.get("device_peak_gib"), (int, float)):
            memory += f", device {last['device_peak_gib']:.2f} GiB"
    graphs = ""
    if isinstance(last.get("xla_graphs_per_step"), (int, float)):
        # runtime/graphs.py: a recompile after warm-up is what makes a Trainium step slow.
        graphs = (f"; XLA: {last['xla_graphs_per_step']:g} graphs and {last['xla_transfers_per_step']:g} "
                  f"device-to-host transfers per step, {int(last.get('xla_recompiles') or 0)} recompiles after "
                  "warm-up")
    return (f"step {step} of {max_steps} ({100 * step / max(max_steps, 1):.0f}%), loss {float(last['loss']):.4f}"
            f"{_rl_figures(last, runner.read_text(metrics))}, about {_duration(left_s)} left at {recent[-1]:.2f} s/step"
            f"{memory}{graphs}")


def _rl_figures(last: dict[str, Any], text: str) -> str:
    """The rl stage's step figures (GRPO's reward, KL and completion length) and its latest held-out reward."""
    shown = "".join(f", {name} {float(last[key]):.3f}" for key, name in (("reward", "reward"), ("kl", "KL"),
                                                                          ("completion_length", "completion length"))
                    if isinstance(last.get(key), (int, float)))
    held_out = [r for r in json_lines(text) if isinstance(r.get("val_reward"), (int, float))]
    if held_out:
        shown += f", held-out reward {float(held_out[-1]['val_reward']):.3f} at step {held_out[-1].get('step')}"
    return shown


# --- what fault tolerance did (runtime/fault_tolerance/attempts.py writes the history) -----------------------------

def attempt_history(entry: dict[str, Any]) -> list[str]:
    """One line per failed attempt of this stage's job: its cause, the rank and node, what the job did about it,
    and, once the restarted run was past the fault, the step it resumed from and the time it cost; and the bad
    nodes the job's node checks named."""
    runner = remote.current()
    path = str(Path(entry["log_dir"]) / f"{entry['stage']}_attempts.jsonl")
    try:
        rows = [r for r in json_lines(runner.read_text(path)) if str(r.get("job_id")) == str(entry["job_id"])]
    except (OSError, ValueError):
        return []
    recovered = [r for r in rows if r.get("event") == "recovered"]
    lines = []
    for row in rows:
        if row.get("event") == "failed":
            what = {"hang": f"hang of rank {row.get('rank')} on {row.get('node')} in {row.get('section')}",
                    "lost node": f"{row.get('node')} reported nothing",
                    "preflight": f"preflight failed on {row.get('node')}"}.get(
                row.get("cause"), f"exit {row.get('exit_code')} of rank {row.get('rank')} on {row.get('node')}")
            line = (f"attempt {row.get('attempt')} (requeue {row.get('slurm_restart', 0)}): {what}"
                    f"{' at step ' + str(row['step']) if row.get('step') else ''}")
            if row.get("time_to_detect_s") is not None:
                line += f", detected in {_duration(row['time_to_detect_s'])}"
            line += f"; {row.get('action')}"
            match = next((r for r in recovered if (r.get("attempt"), r.get("slurm_restart")) ==
                          (row.get("attempt"), row.get("slurm_restart"))), None)
            if match:
                source = {"peer": f" from the peers' memory ({match.get('state_where')}, no file read)",
                          "disk": " from the checkpoint on disk"}.get(match.get("state_from"), "")
                redone = match.get("steps_redone")
                line += (f"; resumed from step {match.get('resumed_from_step')}{source}"
                         f"{f', {redone} step(s) trained again' if redone is not None else ''}, training again "
                         f"{_duration(match.get('time_to_recover_s') or 0)} after, "
                         f"{_duration(match.get('time_lost_s') or 0)} lost")
            lines.append(line)
        elif row.get("event") == "node_check":
            bad = row.get("bad_nodes") or {}
            verdict = ("bad: " + "; ".join(f"{n} ({why})" for n, why in bad.items())) if bad else "every node passed"
            excluded = f", excluded {','.join(row['exclude'])}" if row.get("exclude") else ""
            lines.append(f"node checks after attempt {row.get('attempt')}: {verdict}; {row.get('action')}{excluded}")
    return lines


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
