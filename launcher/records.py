"""The record of a launch, `<base_results_dir>/<run_name>/launch.json`, which `status`, `logs` and `cancel`
read. A relaunch of the same run keeps the previous record as launch.<time>.json.

A run launched on a remote head node (cluster.remote) has its record twice: on the head node, in its run
directory, as a plain Slurm record, and on this machine under remote.state_dir()/runs/<run_name>/, with the
`remote` it was launched on, so that status, logs and cancel work from here.

Every local or Slurm record written here is also added to the run index (run_index.py), so a run is found by its
name from any directory. `cancel` of a local run leaves cancel.json next to the record (the launcher still owns
launch.json while its stage stops, and would overwrite a field written there)."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from launcher import run_index
from launcher.errors import UserError

RECORD = "launch.json"
CANCEL = "cancel.json"


def write(run_dir: Path, record: dict[str, Any]) -> Path:
    path = run_dir / RECORD
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a record
    if not _is_remote_state(run_dir):
        run_index.add(run_dir)
    return path


def _is_remote_state(run_dir: Path) -> bool:
    """The local mirror of a remote launch, or its record here: found by name through remote_runs_dir()."""
    from launcher.remote import state_dir

    return Path(os.path.abspath(run_dir)).is_relative_to(os.path.abspath(state_dir()))


def archive_previous(run_dir: Path) -> None:
    path = run_dir / RECORD
    if path.exists():
        try:
            created = re.sub(r"[^0-9A-Za-z.+_-]", "", str(load(run_dir)["created"]))
        except UserError:
            created = ""
        if not created:  # a damaged record is kept too, named by when it was last written
            written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
            created = "written-" + written.strftime("%Y-%m-%dT%H%M%S")
        os.replace(path, run_dir / f"launch.{created}.json")


def load(run_dir: Path) -> dict[str, Any]:
    """The record of the run in `run_dir`; a UserError naming the file when it is not one (cut short by a full disk,
    edited by hand, or some other program's launch.json)."""
    path = run_dir / RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not a readable launch record ({error}); this run's state is unknown: move the "
                        "file aside, or look elsewhere with --results-dir") from None
    if not isinstance(record, dict) or not isinstance(record.get("stages"), list) or \
            not all(isinstance(e, dict) and {"stage", "job_id", "log_dir"} <= e.keys() for e in record["stages"]):
        raise UserError(f"{path}: not a launch record written by nxdt-launch (no list of stages); move it aside, "
                        "or look elsewhere with --results-dir")
    record.setdefault("executor", "?")
    record.setdefault("created", "")
    record.setdefault("run_name", run_dir.name)
    record["cancelled"] = cancelled_stages(run_dir, record)
    return record


def earlier(run_dir: Path) -> list[dict[str, Any]]:
    """The records of the run's earlier launches (archive_previous kept them as launch.<created>.json), newest
    first; a damaged one is left out (status names the current record's damage, and these are history)."""
    found = []
    for path in sorted(run_dir.glob("launch.*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("stages"), list) and \
                all(isinstance(e, dict) and {"stage", "job_id", "log_dir"} <= e.keys() for e in record["stages"]):
            record.setdefault("executor", "?")
            record.setdefault("run_name", run_dir.name)
            found.append(record)
    return found


def write_cancel(run_dir: Path, record: dict[str, Any], stages: list[str], how: str) -> None:
    """Note that `cancel` stopped these stages of this launch (named by its `created`, so that a relaunch of the
    run is not shown as cancelled)."""
    note = {"created": record["created"], "stages": stages, "how": how,
            "requested": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = run_dir / (CANCEL + ".tmp")
    tmp.write_text(json.dumps(note, indent=2) + "\n")
    os.replace(tmp, run_dir / CANCEL)


def cancelled_stages(run_dir: Path, record: dict[str, Any]) -> list[str]:
    try:
        note = json.loads((run_dir / CANCEL).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    if not isinstance(note, dict) or note.get("created") != record.get("created"):
        return []
    return [s for s in note.get("stages") or [] if isinstance(s, str)]


def remote_runs_dir() -> Path:
    from launcher.remote import state_dir

    return state_dir() / "runs"


def find_run(target: str, results_dir: Path) -> Path | None:
    """A run named by its directory, by its name under the results directory, or a remote run by its name.
    (Not the index: runs.require_run asks it when none of these has the run.)"""
    for candidate in (Path(target), results_dir / target, remote_runs_dir() / target):
        try:
            if (candidate / RECORD).exists():
                return candidate.resolve()
        except OSError:  # a name longer than a file name may be, or a path through a file: no run is there
            continue
    return None


def all_runs(results_dir: Path) -> list[Path]:
    here = sorted(p.parent for p in results_dir.glob(f"*/{RECORD}"))
    names = {p.name for p in here}
    return here + sorted(p.parent for p in remote_runs_dir().glob(f"*/{RECORD}") if p.parent.name not in names)
