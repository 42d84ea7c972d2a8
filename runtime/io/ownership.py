# Which run owns a directory, and what a launch or a stage may do to a directory it does not own (issue 57: another
# run's launch once resumed from a live run's checkpoints and wrote its own steps among them, pruned a finished run's
# steps by its save_top_k, and an export with overwrite deleted the checkpoints it was exporting).
#
# A run owns its run directory (<base_results_dir>/<run_name>) and everything below it, and the directories outside
# it that its launches write into (a checkpoint dirpath elsewhere, an import's checkpoint_dir, a stage's results
# directory elsewhere). Each is recorded by a small JSON file in it, OWNER, naming the run by an id drawn when its
# run directory was first launched into (so a run directory moved elsewhere stays the same run), its name and where
# it was. The owner of a path is the one recorded in the nearest of it and its ancestors; a run directory from
# before these records counts by its launch record (launch.json) as owned by itself.
#
# The launcher asks here before it writes anything (launcher/launch.py), and records its run's ownership once it
# holds the run's launch lock; the runtime asks again where it would resume from, write into or prune a checkpoint
# directory (runtime/checkpoint/session.py) and before an export's overwrite deletes a directory
# (runtime/convert/__main__.py). Reading another run's checkpoints is never refused: exporting or evaluating them,
# or starting a training from one by exp_manager.resume_from_checkpoint, reads only. Standard library only: the
# launcher imports this with no torch.
from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from runtime.io.files import publish_first, temp_name

OWNER = ".nxdt-run.json"
_LAUNCH_RECORD = "launch.json"  # launcher/records.py's RECORD: a run directory written before OWNER existed
_STEP = re.compile(r"^step_\d{8}\.[0-9a-f]+$")  # a checkpoint directory's name (runtime/checkpoint/manager.py)
# An overwrite replaces a model directory (a config, a few safetensors, a tokenizer): a tree this large is not one,
# and is not walked further to prove it holds nothing of a run's.
_SCAN_LIMIT = 10_000


@dataclass(frozen=True)
class Owner:
    run_id: str      # drawn once per run directory
    run_name: str
    run_dir: str     # where the run directory was when it claimed the directory

    def describe(self) -> str:
        return f"run {self.run_name} ({self.run_dir})"


def local(path: object) -> bool:
    """Whether `path` is on a file system this process can look at (not s3:// or another URL, not empty)."""
    return isinstance(path, (str, os.PathLike)) and bool(str(path)) and "://" not in str(path)


def _read(directory: Path) -> Owner | None:
    """The owner recorded in `directory` itself (its OWNER, else a launch record that makes it a run directory)."""
    try:
        found = json.loads((directory / OWNER).read_text())
        return Owner(str(found["run_id"]), str(found["run_name"]), str(found["run_dir"]))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        return Owner(f"unreadable:{directory}", directory.name, str(directory))  # someone's: never ours to take
    try:
        if (directory / _LAUNCH_RECORD).is_file():
            return Owner(f"path:{os.path.realpath(directory)}", directory.name, str(directory))
    except OSError:
        pass
    return None


def recorded_at(directory: str | os.PathLike) -> Owner | None:
    """The run recorded in `directory` itself: a run directory's own identity (None before its first launch)."""
    return _read(Path(os.path.abspath(directory)))


def owner(path: str | os.PathLike) -> Owner | None:
    """The run that owns `path`: the nearest record in it or one of its ancestors; None where no run does."""
    here = Path(os.path.abspath(path))
    for directory in (here, *here.parents):
        try:
            if not directory.is_dir():
                continue
        except OSError:
            return None  # a name the file system cannot hold: the path-length rule names it
        if (found := _read(directory)) is not None:
            return found
    return None


def foreign(key: str, path: str | os.PathLike, mine: Owner | None, would: str, fix: str) -> str | None:
    """One line when `path` belongs to a run other than `mine` (None: a run with no record yet), else None.
    `would`: what this launch or stage would do there; `fix`: what to set instead."""
    if not local(path):
        return None  # S3 keeps no ownership record: a prefix is the user's to keep apart
    theirs = owner(path)
    if theirs is None or (mine is not None and theirs.run_id == mine.run_id):
        return None
    me = f"run {mine.run_name}" if mine is not None else "this run"
    return f"{key}: {path} belongs to {theirs.describe()}; {me} would {would}; {fix}"


# A trainer's checkpoint directory in another run's: what the trainer would do there, and the read-only way instead.
CHECKPOINTS_WOULD = "resume from its checkpoints, save among them and prune them (save_top_k)"


def checkpoints_fix(prefix: str, dirpath: object, own: object) -> str:
    """`prefix`: the stage's key prefix ("training." at launch, "" in the stage's own config); `own`: a checkpoint
    directory of the run's own to suggest."""
    key = f"{prefix}exp_manager.checkpoint_callback_params.dirpath"
    return (f"keep {key} this run's own (e.g. {key}={own}) and start from that run's checkpoint, read only, with "
            f"{prefix}exp_manager.resume_from_checkpoint={dirpath}")


def of_run(run_dir: str | os.PathLike, run_name: str) -> Owner:
    """The identity a launch records for its run: the one its run directory holds, else a new one (a run's first
    launch, or a run directory of before these records)."""
    found = recorded_at(run_dir)
    if found is not None and not found.run_id.startswith("path:"):
        return found
    return Owner(secrets.token_hex(8), run_name, os.path.abspath(run_dir))


def claim(directory: str | os.PathLike, mine: Owner) -> Owner:
    """Record `mine` as the owner of `directory` (made if missing) unless it holds a record already; returns the
    owner recorded there now: `mine`, or the run that got there first."""
    directory = Path(os.path.abspath(directory))
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / OWNER).exists():
        tmp = temp_name(directory / OWNER)
        tmp.write_text(json.dumps({"run_id": mine.run_id, "run_name": mine.run_name, "run_dir": mine.run_dir}) + "\n")
        publish_first(tmp, directory / OWNER)  # two launches claiming at once: the first one's record stays
    return _read(directory) or mine


def overwrite_problem(key: str, target: str | os.PathLike, inputs: list[str | os.PathLike]) -> str | None:
    """Why replacing the directory `target` (an export's conversion.overwrite) would delete what must stay: it is,
    or is an ancestor of, one of the stage's `inputs`, or it holds any run's checkpoints or directories (a
    checkpoint's COMMIT, an ownership record, a launch record or lock), or it is too large to tell. None: it may
    be replaced."""
    if not local(target):
        return None
    out = os.path.realpath(target)
    fix = f"choose a new directory for the output, e.g. {key}={out.rstrip(os.sep)}_hf"
    for source in inputs:
        if local(source):
            there = os.path.realpath(source)
            if there == out or there.startswith(out.rstrip(os.sep) + os.sep):
                return f"{key}: {target} holds the stage's own input {source}, which overwrite would delete; {fix}"
    if not os.path.isdir(out):
        return None
    seen = 0
    for root, dirs, files in os.walk(out):
        seen += len(dirs) + len(files)
        names = set(files)
        held = ("a checkpoint" if "COMMIT" in names and _STEP.match(os.path.basename(root)) else
                "a run's records" if names & {OWNER, _LAUNCH_RECORD, ".launch.lock"} else None)
        if held:
            return f"{key}: {target} holds {held} ({root}), which overwrite would delete; {fix}"
        if seen > _SCAN_LIMIT:
            return (f"{key}: {target} holds over {_SCAN_LIMIT} files and directories, not a model directory "
                    f"overwrite may replace; {fix}")
    return None
