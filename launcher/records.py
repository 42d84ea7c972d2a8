"""The record of a launch, `<base_results_dir>/<run_name>/launch.json`, which `status`, `logs` and `cancel`
read. A relaunch of the same run keeps the previous record as launch.<time>.json."""

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


def find_run(target: str, results_dir: Path) -> Path | None:
    """A run named by its directory, or by its name under the results directory."""
    for candidate in (Path(target), results_dir / target):
        if (candidate / RECORD).exists():
            return candidate.resolve()
    return None


def all_runs(results_dir: Path) -> list[Path]:
    return sorted(p.parent for p in results_dir.glob(f"*/{RECORD}"))
