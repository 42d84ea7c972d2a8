"""The thin side of the Slurm executor: sbatch, job state, scancel. Every command goes through the runner of
this invocation (remote.py: a subprocess here, or SSH to a head node); what the scripts contain is decided
in render.py. Works when Slurm accounting is off: the state of a job
that has left the queue then comes from `scontrol show job` while slurmctld remembers it, and after that
from the exit file the job script writes."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher import remote

# States after which a job will not run again.
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


class SlurmError(RuntimeError):
    """Slurm refused or failed a request; the message is Slurm's own first line."""



@dataclass(frozen=True)
class JobState:
    state: str            # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... or UNKNOWN
    reason: str = ""      # Slurm's reason (DependencyNeverSatisfied, NonZeroExitCode, ...) or the exit code

    def __str__(self) -> str:
        return f"{self.state} ({self.reason})" if self.reason and self.reason != "None" else self.state


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    runner = remote.current()
    result = runner.run(cmd, timeout=60)
    if result.returncode == 127 and "not found" in result.stderr:
        raise SlurmError(f"{cmd[0]} not found on PATH on {runner.where}: is it a Slurm login node?")
    return result


def partition_nodes(partition: str | None) -> list[str]:
    """Every node of the partition (of the cluster, with none) as sinfo lists them; [] where sinfo does not answer
    (then nothing is judged by them)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N", *([f"--partition={partition}"] if partition else [])]
    try:
        done = _run(argv)
    except (SlurmError, subprocess.TimeoutExpired):
        return []
    return sorted(set(done.stdout.split())) if done.returncode == 0 else []


def dependency_flag(kind: str, after: str | None) -> list[str]:
    """afterok/afterany wait for the previous stage; singleton also keeps one job of this name at a time.
    A job whose dependency can never be met is cancelled (not left pending forever)."""
    if after is None:
        return ["--dependency=singleton"] if kind == "singleton" else []
    condition = f"afterok:{after},singleton" if kind == "singleton" else f"{kind}:{after}"
    return [f"--dependency={condition}", "--kill-on-invalid-dep=yes"]


def submit(script: Path, *, dependency: str, after: str | None) -> str:
    result = _run(["sbatch", "--parsable", *dependency_flag(dependency, after), str(script)])
    if result.returncode != 0:
        message = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise SlurmError(f"sbatch {script.name}: {message[-1] if message else f'exit {result.returncode}'}")
    return result.stdout.strip().split(";")[0]  # "<id>;<cluster>" on multi-cluster setups


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        result = _run(["scancel", *job_ids])
        if result.returncode != 0:
            raise SlurmError(f"scancel: {result.stderr.strip()}")


def _parse_scontrol(text: str) -> list[dict[str, str]]:
    records = []
    for block in re.split(r"\n\s*\n", text.strip()):
        fields = dict(re.findall(r"(\w+)=(\S*)", block))
        if "JobState" in fields:
            records.append(fields)
    return records


def _combine(states: list[JobState]) -> JobState:
    """One state for an array's tasks: the worst finished one, else whatever is still going."""
    for state in ("FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED", "RUNNING", "PENDING"):
        for s in states:
            if s.state == state:
                return s
    return states[0]


def state(job_id: str, exit_files: list[Path]) -> JobState:
    found = _run(["scontrol", "show", "job", job_id])
    records = _parse_scontrol(found.stdout) if found.returncode == 0 else []
    if records:
        return _combine([JobState(r["JobState"], r.get("Reason", "")) for r in records])
    accounted = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    rows = [line.split("|") for line in accounted.stdout.splitlines() if line.strip()]
    if accounted.returncode == 0 and rows:
        return _combine([JobState(row[0].split()[0], f"exit {row[1]}") for row in rows])
    return from_exit_files(exit_files)


def from_exit_files(exit_files: list[Path]) -> JobState:
    codes = [remote.current().read_text(str(f)).strip() for f in exit_files]
    if not codes:
        return JobState("UNKNOWN", "not in the queue, no accounting, no exit file")
    failed = [c for c in codes if c != "0"]
    return JobState("FAILED", f"exit {failed[0]}") if failed else JobState("COMPLETED")


# --- Slurm's hostlist syntax (sbatch --nodelist/--exclude, cluster-validate's node choice) ---------------------
def expand_hostlist(expression: str) -> list[str]:
    """Slurm's hostlist syntax: `node[1-3,7],gpu[01-02]` -> node1 node2 node3 node7 gpu01 gpu02. Raises
    ValueError, saying what it could not read, for anything else (`node[a-b]`, `node[1-`, `a,,b`)."""
    return [name for item in split_hostlist(expression) for name in _expand_item(item)]


def split_hostlist(expression: str) -> list[str]:
    """`node[01-03,7],gpu1` -> ['node[01-03,7]', 'gpu1']: the commas inside brackets belong to a range."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(expression):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(expression[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise ValueError(f"{expression!r}: brackets do not pair up (Slurm hostlists do not nest them)")
    if depth:
        raise ValueError(f"{expression!r}: a '[' is never closed")
    items.append(expression[start:])
    if not all(item.strip() for item in items):
        raise ValueError(f"{expression!r}: an empty node name between commas")
    return items


def _expand_item(item: str) -> list[str]:
    match = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    tails = _expand_item(rest) if rest else [""]  # rack[1-2]-node[1-3]: every combination
    names = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{item!r}: {part!r} is not a number or a range such as 1-8")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{item!r}: the range {part} runs backwards")
        width = len(low)  # node[01-03] keeps the zero padding
        names += [f"{prefix}{number:0{width}d}{tail}" for number in range(first, last + 1) for tail in tails]
    return names
