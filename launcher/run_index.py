"""Which results directory holds each launched run, so that `status`, `logs` and `cancel` find a run by its name
from any directory. One small JSON file in the user's config directory maps a run name to the run directories
launched under it:

    {"version": 1, "runs": {"gpt3_tiny": ["/fsx/results/gpt3_tiny", "/home/me/results/gpt3_tiny"]}}

records.write adds the run on every launch. An entry whose launch.json has gone (a deleted results directory)
is skipped on reading and dropped on the next write. The index is a convenience: if it cannot be read or
written the launch goes on, and `--results-dir` still finds every run."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

# Points the index somewhere else (tests, or a shared account that wants one index per project).
ENV = "NXDT_USER_CONFIG_DIR"
INDEX = "runs.json"
RECORD = "launch.json"  # records.RECORD; not imported from there, which imports this module


def config_dir() -> Path:
    default = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "nxdt-launch"
    return Path(os.environ.get(ENV) or default)


def index_path() -> Path:
    return config_dir() / INDEX


def _read() -> dict[str, list[str]]:
    """The index as written, {} when there is none or it is not ours (a damaged file is replaced on the next
    write, with a warning then: losing a convenience must not stop a launch)."""
    try:
        data = json.loads(index_path().read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict):
        return {}
    return {name: [d for d in dirs if isinstance(d, str)] for name, dirs in runs.items()
            if isinstance(name, str) and isinstance(dirs, list)}


@contextmanager
def _locked():
    """Two launches at once (two shells, a search that launches many runs) must not lose each other's entry."""
    import fcntl

    path = index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _live(dirs: list[str]) -> list[str]:
    return [d for d in dirs if (Path(d) / RECORD).is_file()]


def add(run_dir: Path) -> None:
    """Record `run_dir` (<base_results_dir>/<run_name>) under its name. Never raises for the file system: a
    read-only home or a full disk is one warning."""
    run_dir = Path(os.path.abspath(run_dir))
    name = run_dir.name
    if str(run_dir) in _read().get(name, []):
        return  # a local launch writes its record once per stage; the index only changes on the first
    try:
        with _locked():
            runs = {n: kept for n, dirs in _read().items() if (kept := _live(dirs))}
            runs[name] = [*[d for d in runs.get(name, []) if d != str(run_dir)], str(run_dir)]
            path = index_path()
            tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": 1, "runs": runs}, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)  # a reader never sees half an index
    except OSError as error:
        print(f"warning: could not record run {name!r} in {index_path()} ({error.strerror or error}); find it "
              f"later with --results-dir {run_dir.parent} (or set {ENV} to a writable directory)",
              file=sys.stderr)


def lookup(name: str) -> list[Path]:
    """The run directories recorded under `name` that still hold a launch record, oldest launch first."""
    return [Path(d) for d in _live(_read().get(name, []))]


def all_runs() -> list[Path]:
    """Every recorded run directory that still holds a launch record."""
    return [Path(d) for dirs in _read().values() for d in _live(dirs)]
