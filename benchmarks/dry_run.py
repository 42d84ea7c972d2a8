"""Process wall time of `nxdt-launch stages=[training] training=gpt3/175b cluster_type=slurm --dry-run`,
median of several runs, next to references timed in the same run:

- python -c pass: the interpreter's own start-up, the floor for any Python launcher;
- Hydra compose alone: what composing our conf/ costs without validation, rendering or writing;
- import torch: what a launcher that imported torch at start-up would pay before doing anything.

NeMo-Framework-Launcher itself is not installable here (not on PyPI), so it is not in the table.

    python benchmarks/dry_run.py [--runs 11]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        compose = (
            "from launcher.compose import compose, resolve; "
            "resolve(compose(['stages=[training]', 'training=gpt3/175b']))"
        )
        rows = {
            "nxdt-launch 175B training --dry-run": [
                sys.executable, "-m", "launcher.cli", "stages=[training]", "training=gpt3/175b",
                "cluster_type=slurm", "--dry-run", f"base_results_dir={out}",
            ],
            "python -c pass": [sys.executable, "-c", "pass"],
            "Hydra compose of conf/ alone": [sys.executable, "-c", compose],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        }
        wall(rows["nxdt-launch 175B training --dry-run"], 2)  # warm the file cache and .pyc files
        medians = {name: wall(cmd, args.runs) for name, cmd in rows.items()}
    ours = medians["nxdt-launch 175B training --dry-run"]
    print(f"| command | median wall (s), {args.runs} runs | ratio to the dry run |")
    print("| --- | --- | --- |")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.3f} | {seconds / ours:.2f} |")


if __name__ == "__main__":
    main()
