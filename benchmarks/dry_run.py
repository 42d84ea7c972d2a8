"""Process wall time of `nxdt-launch stages=[training] training=gpt3/175b cluster_type=slurm --dry-run`,
median of several runs, next to references timed in the same run:

- python -c pass: the interpreter's own start-up, the floor for any Python launcher;
- Hydra compose alone: what composing our conf/ costs without validation, rendering or writing;
- import torch: what a launcher that imported torch at start-up would pay before doing anything.

NeMo-Framework-Launcher itself is not installable here (not on PyPI), so it is not in the table.
With --baseline REV the same dry run of an earlier commit (a git worktree of REV) is timed in the same run,
interleaved with ours, so a change's cost is a ratio measured under the same load.

    python benchmarks/dry_run.py [--runs 11] [--baseline REV]
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


def wall(cmd: list[str], runs: int, cwd: Path = REPO) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def versus_baseline(rev: str, cmd: list[str], runs: int) -> tuple[float, float]:
    """Median wall of `cmd` run in this checkout and in a worktree of `rev`, alternating run by run."""
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ours, theirs = [], []
            wall(cmd, 2, Path(tree))  # `python -m launcher.cli` from the worktree imports the worktree's launcher
            for _ in range(runs):
                ours.append(wall(cmd, 1))
                theirs.append(wall(cmd, 1, Path(tree)))
            return statistics.median(ours), statistics.median(theirs)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--baseline", help="a git revision whose dry run is timed beside ours")
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
        if args.baseline:
            ours, theirs = versus_baseline(args.baseline, rows["nxdt-launch 175B training --dry-run"], args.runs)
            print(f"| dry run | median wall (s), {args.runs} runs, interleaved | ratio to {args.baseline} |")
            print("| --- | --- | --- |")
            print(f"| this checkout | {ours:.3f} | {ours / theirs:.2f} |")
            print(f"| {args.baseline} | {theirs:.3f} | 1.00 |")
            return
        medians = {name: wall(cmd, args.runs) for name, cmd in rows.items()}
    ours = medians["nxdt-launch 175B training --dry-run"]
    print(f"| command | median wall (s), {args.runs} runs | ratio to the dry run |")
    print("| --- | --- | --- |")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.3f} | {seconds / ours:.2f} |")


if __name__ == "__main__":
    main()
