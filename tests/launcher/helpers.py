"""Shared by the launcher tests: compose a config the way the CLI does, with paths fixed so that rendered
scripts are the same on every machine (golden files depend on it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launcher.compose import compose, resolve

REPO = Path(__file__).resolve().parents[2]

STABLE = ["base_results_dir=/results", "data_dir=/data", "launcher_scripts_path=/launcher", "python=/opt/venv/bin/python"]


def resolved(*overrides: str, stable: bool = True) -> dict:
    return resolve(compose([*(STABLE if stable else []), *overrides]))


def nxdt(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh process, as a user would: this checkout's code, from any cwd (an installed
    nxdt-launch elsewhere on the machine must not stand in for it)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=cwd or REPO, env={**os.environ, "PYTHONPATH": path, **(env or {})}, capture_output=True, text=True,
        timeout=timeout,
    )
