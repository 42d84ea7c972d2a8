"""One benchmark of this checkout against the same benchmark at an earlier commit, run alternately in one session.

A refactor is "within noise" only when measured side by side: this runs `benchmarks/<name>.py` from a git
worktree of REV and from this checkout, alternating (REV, ours, REV, ours, ...) so drift in machine load hits both,
reads the numbers out of each run's markdown table, and prints the median of each chosen figure with the ratio
ours / REV and the spread (min-max) of each side, which is the noise the ratio has to be read against.

    python benchmarks/versus.py 2f6cb41 train_throughput --runs 3 -- --layers 2 --rounds 1
    python benchmarks/versus.py 2f6cb41 checkpoint --runs 3 -- --layers 8 --repeats 2
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The figures worth comparing, per benchmark: (table row label, column header).
FIGURES = {
    "train_throughput": [("gpt", "ours tok/s"), ("llama", "ours tok/s"),
                         ("gpt", "ours / HF, paired"), ("llama", "ours / HF, paired")],
    "checkpoint": [("ours", "save (s)"), ("ours", "load (s)")],
}


def table_cells(text: str) -> dict[tuple[str, str], float]:
    """Every numeric cell of every markdown table in `text`, by (row label, column header)."""
    cells, header = {}, None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if header is None:
            header = parts
        elif not set("".join(parts)) <= set("-: "):
            for column, cell in zip(header[1:], parts[1:]):
                number = re.match(r"-?\d+(\.\d+)?", cell)
                if number:
                    cells[(parts[0], column)] = float(number.group())
    return cells


def run(tree: Path, name: str, args: list[str]) -> dict[tuple[str, str], float]:
    result = subprocess.run([sys.executable, str(tree / "benchmarks" / f"{name}.py"), *args], cwd=tree,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{name} failed in {tree}:\n{result.stderr[-3000:]}")
    return table_cells(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the git revision to compare against")
    parser.add_argument("name", choices=sorted(FIGURES), help="the benchmark (benchmarks/<name>.py)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side")
    parser.add_argument("--ours", help="a git revision to run instead of this checkout (e.g. to leave out work in "
                                       "progress)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:split]), argv[split + 1:]  # after --: the benchmark's own arguments
    figures = FIGURES[args.name]
    samples = {side: {f: [] for f in figures} for side in ("base", "ours")}
    with tempfile.TemporaryDirectory() as tree, tempfile.TemporaryDirectory() as ours_tree:
        subprocess.run(["git", "worktree", "add", "--detach", tree, args.rev], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.ours:
            subprocess.run(["git", "worktree", "add", "--detach", ours_tree, args.ours], cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ours = Path(ours_tree) if args.ours else REPO
        try:
            for i in range(args.runs):
                for side, where in (("base", Path(tree)), ("ours", ours)):
                    cells = run(where, args.name, extra)
                    for figure in figures:
                        if figure not in cells:
                            sys.exit(f"no {figure} in the output of {args.name} ({side})")
                        samples[side][figure].append(cells[figure])
                print(f"# run {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
        finally:
            for used in [tree] + ([ours_tree] if args.ours else []):
                subprocess.run(["git", "worktree", "remove", "--force", used], cwd=REPO, check=True)
    mine = args.ours or "this checkout"
    print(f"| {args.name} {' '.join(extra)} | {args.rev} median (min-max) | {mine} median (min-max) | "
          f"ratio {mine} / {args.rev} |")
    print("| --- | --- | --- | --- |")
    for figure in figures:
        base, ours = samples["base"][figure], samples["ours"][figure]
        spread = lambda xs: f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"  # noqa: E731
        print(f"| {figure[0]}: {figure[1]} | {spread(base)} | {spread(ours)} | "
              f"{statistics.median(ours) / statistics.median(base):.3f} |")


if __name__ == "__main__":
    main()
