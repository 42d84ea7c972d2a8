"""Process wall time and CPU time (user + sys of the child) of
`nxdt-launch stages=[training] training=gpt3/175b cluster_type=slurm --dry-run base_results_dir=DIR`, with a new
results directory DIR each run, median of several runs, next to references timed in the same run:

- cache warm / cold / off: the launch cache (launcher/cache.py) holding the config and compiled templates of an
  earlier launch into another results directory under another run name (training.run.name=warm_up), emptied before
  each run (compose, then store), or switched off (NXDT_LAUNCH_CACHE=off, compose only);
- on pcluster_trn1: the cluster switches the recipe to gpt3/175b_trn1 (launcher/targets.py, one compose uncached);
- python -c pass: the interpreter's own start-up, the floor for any Python launcher;
- Hydra compose alone: what composing our conf/ with Hydra costs without validation, rendering or writing, and the
  same compose without Hydra (launcher/plain_compose.py, what a launch composes on a cache miss);
- import torch: what a launcher that imported torch at start-up would pay before doing anything.

NeMo-Framework-Launcher itself is not installable here (not on PyPI), so it is not in the table.
With --baseline REV the same dry run of an earlier commit (a git worktree of REV) is timed in the same run,
interleaved with ours (warm and cold cache) and with `python -c pass` and the composes alone, so a change's cost
is a ratio measured under the same load; the load average is printed before and after.
CPU time is the better figure on a shared machine: other work stretches wall time, not the CPU a run uses.
Every command runs with its bytecode present, as an installed or once-run checkout has it: the children write and
read .pyc files under a temporary PYTHONPYCACHEPREFIX (PYTHONDONTWRITEBYTECODE is dropped), filled by untimed runs.

    python benchmarks/dry_run.py [--runs 11] [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


# Set by main: where the children keep their bytecode, and where each dry run gets a results directory of its own.
BYTECODE: dict[str, str] = {}
RESULTS: list[Path] = []


def timed(cmd: list[str], runs: int, cwd: Path = REPO, env: dict[str, str] | None = None,
          before: Callable[[], None] | None = None) -> tuple[float, float]:
    """Median (wall, CPU) seconds of `cmd`; CPU is the child's user + sys time (os.wait4). `before` runs ahead of
    each run, untimed. A dry run gets `base_results_dir=` a new directory each run."""
    walls, cpus = [], []
    for _ in range(runs):
        if before:
            before()
        where = [f"base_results_dir={tempfile.mkdtemp(dir=RESULTS[0])}"] if "--dry-run" in cmd else []
        start = time.perf_counter()
        child = subprocess.Popen([*cmd, *where], cwd=cwd, env={**_environment(cwd), **(env or {})},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)
        walls.append(time.perf_counter() - start)
        cpus.append(usage.ru_utime + usage.ru_stime)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)}) in {cwd}")
    return statistics.median(walls), statistics.median(cpus)


def _environment(cwd: Path) -> dict[str, str]:
    """This environment, with the bytecode of the checkout at `cwd` written and read under BYTECODE's folder."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(Path(BYTECODE["root"]) / cwd.name)}


def warm_up(cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
    """Bytecode written, and the cache filled by a dry run under another run name (and results directory)."""
    timed([*cmd, "training.run.name=warm_up"] if "--dry-run" in cmd else cmd, 2, cwd, env)


def versus_baseline(rev: str, commands: dict[str, list[str]], runs: int, cache: Path,
                    others: dict[str, list[str]]) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) of each command in this checkout, warm and cold cache, and in a worktree of `rev`,
    alternating run by run, and of each of `others` in this checkout in the same rounds. Keys: "<name>,
    <warm|cold|rev|rev cold>", and the names of `others`."""
    warm, cold = {"NXDT_LAUNCH_CACHE": str(cache)}, {"NXDT_LAUNCH_CACHE": str(cache / "cold")}
    theirs = {"NXDT_LAUNCH_CACHE": str(cache / "rev")}  # warmed as ours, by a launch under another run name
    theirs_cold = {"NXDT_LAUNCH_CACHE": str(cache / "rev-cold")}
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            samples: dict[str, list[tuple[float, float]]] = {}
            for cmd in commands.values():
                warm_up(cmd, theirs, Path(tree))  # `python -m launcher.cli` from the worktree imports the worktree's launcher
                warm_up(cmd, warm)
            for cmd in others.values():
                warm_up(cmd, warm)
            for _ in range(runs):
                for name, cmd in others.items():
                    samples.setdefault(name, []).append(timed(cmd, 1, env=warm))
                for name, cmd in commands.items():
                    samples.setdefault(f"{name}, warm", []).append(timed(cmd, 1, env=warm))
                    samples.setdefault(f"{name}, cold", []).append(
                        timed(cmd, 1, env=cold, before=lambda: _empty(cache / "cold")))
                    samples.setdefault(f"{name}, {rev}", []).append(timed(cmd, 1, Path(tree), env=theirs))
                    samples.setdefault(f"{name}, {rev} cold", []).append(
                        timed(cmd, 1, Path(tree), env=theirs_cold, before=lambda: _empty(cache / "rev-cold")))
            return {name: (statistics.median(s[0] for s in pairs), statistics.median(s[1] for s in pairs))
                    for name, pairs in samples.items()}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, check=True)


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _empty(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--baseline", help="a git revision whose dry run is timed beside ours")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache_root, \
            tempfile.TemporaryDirectory() as bytecode:
        cache = Path(cache_root)
        RESULTS.append(Path(out))
        BYTECODE["root"] = bytecode
        warm, off = {"NXDT_LAUNCH_CACHE": str(cache)}, {"NXDT_LAUNCH_CACHE": "off"}
        cold = {"NXDT_LAUNCH_CACHE": str(cache / "cold")}
        compose = (
            "from launcher.compose import compose, resolve; "
            "resolve(compose(['stages=[training]', 'training=gpt3/175b']))"
        )
        plain = (
            "from launcher.plain_compose import compose; from launcher.plain_resolve import resolve; "
            "resolve(compose(['stages=[training]', 'training=gpt3/175b']))"
        )
        others = {"python -c pass": [sys.executable, "-c", "pass"],
                  "Hydra compose of conf/ alone": [sys.executable, "-c", compose],
                  "compose of conf/ without Hydra alone (plain_compose)": [sys.executable, "-c", plain]}
        dry_run = [sys.executable, "-m", "launcher.cli", "stages=[training]", "training=gpt3/175b",
                   "cluster_type=slurm", "--dry-run"]
        trn1 = [*dry_run, "cluster=pcluster_trn1"]
        if args.baseline:
            commands = {"175B": dry_run, "175B on pcluster_trn1": trn1}
            print(f"load before: {_load()}")
            medians = versus_baseline(args.baseline, commands, args.runs, cache, others)
            print(f"load after: {_load()}")
            print(f"| dry run | median wall (s), {args.runs} runs, interleaved | median CPU (s) "
                  f"| CPU ratio to {args.baseline}, same cache state |")
            print("| --- | --- | --- | --- |")
            for name in commands:
                for kind, theirs_key in (("warm", args.baseline), ("cold", f"{args.baseline} cold")):
                    theirs_cpu = medians[f"{name}, {theirs_key}"][1]
                    for label, key in ((f"{name}, this checkout, cache {kind}", kind),
                                       (f"{name}, {args.baseline}, cache {kind}", theirs_key)):
                        wall, cpu = medians[f"{name}, {key}"]
                        print(f"| {label} | {wall:.3f} | {cpu:.3f} | {cpu / theirs_cpu:.2f} |")
            floor = medians["python -c pass"][1]
            print(f"\n| command (this checkout) | median wall (s) | median CPU (s) | CPU ratio to python -c pass |")
            print("| --- | --- | --- | --- |")
            kinds = ("warm", "cold", args.baseline, f"{args.baseline} cold")
            for key in (*(f"{name}, {kind}" for name in commands for kind in kinds), *others):
                wall, cpu = medians[key]
                print(f"| {key} | {wall:.3f} | {cpu:.3f} | {cpu / floor:.2f} |")
            return
        rows: dict[str, tuple[list[str], dict[str, str], Callable[[], None] | None]] = {
            "nxdt-launch 175B training --dry-run, cache warm": (dry_run, warm, None),
            "nxdt-launch 175B training --dry-run, cache cold": (dry_run, cold, lambda: _empty(cache / "cold")),
            "nxdt-launch 175B training --dry-run, cache off": (dry_run, off, None),
            "the same on pcluster_trn1 (175b_trn1), cache warm": (trn1, warm, None),
            "the same on pcluster_trn1 (175b_trn1), cache cold": (trn1, cold, lambda: _empty(cache / "cold")),
            "python -c pass": ([sys.executable, "-c", "pass"], off, None),
            "Hydra compose of conf/ alone": ([sys.executable, "-c", compose], off, None),
            "compose of conf/ without Hydra alone (plain_compose)": ([sys.executable, "-c", plain], off, None),
            "python -c 'import torch'": ([sys.executable, "-c", "import torch"], off, None),
        }
        for cmd, _, _ in rows.values():
            warm_up(cmd, warm)  # the file cache, the launch cache and the .pyc files
        medians = {name: timed(cmd, args.runs, env=env, before=before) for name, (cmd, env, before) in rows.items()}
    ours_wall, ours_cpu = medians["nxdt-launch 175B training --dry-run, cache warm"]
    print(f"| command | median wall (s), {args.runs} runs | median CPU (s), user + sys | CPU ratio to the dry run |")
    print("| --- | --- | --- | --- |")
    for name, (wall, cpu) in medians.items():
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {cpu / ours_cpu:.2f} |")


if __name__ == "__main__":
    main()
