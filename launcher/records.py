"""The record of a launch, `<base_results_dir>/<run_name>/launch.json`, which `status`, `logs` and `cancel`
read. A relaunch of the same run keeps the previous record as launch.<time>.json.

A run launched on a remote head node (cluster.remote) has its record twice: on the head node, in its run
directory, as a plain Slurm record, and on this machine under remote.state_dir()/runs/<run_name>/, with the
`remote` it was launched on, so that status, logs and cancel work from here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RECORD = "launch.json"


def write(run_dir: Path, record: dict[str, Any]) -> Path:
    path = run_dir / RECORD
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def archive_previous(run_dir: Path) -> None:
    path = run_dir / RECORD
    if path.exists():
        created = json.loads(path.read_text()).get("created", "old").replace(":", "")
        os.replace(path, run_dir / f"launch.{created}.json")


def load(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / RECORD).read_text())


def remote_runs_dir() -> Path:
    from launcher.remote import state_dir

    return state_dir() / "runs"


def find_run(target: str, results_dir: Path) -> Path | None:
    """A run named by its directory, by its name under the results directory, or a remote run by its name."""
    for candidate in (Path(target), results_dir / target, remote_runs_dir() / target):
        if (candidate / RECORD).exists():
            return candidate.resolve()
    return None


def all_runs(results_dir: Path) -> list[Path]:
    here = sorted(p.parent for p in results_dir.glob(f"*/{RECORD}"))
    names = {p.name for p in here}
    return here + sorted(p.parent for p in remote_runs_dir().glob(f"*/{RECORD}") if p.parent.name not in names)
