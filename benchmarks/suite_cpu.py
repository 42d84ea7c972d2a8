"""Where the test suite's CPU goes: seconds of CPU per test, its own and its waited children's (subprocesses,
torchrun launches, forked ranks), which a loaded machine does not inflate the way it inflates wall time.

    # as a pytest plugin, beside any other options (xdist workers each write their own file):
    NXDT_SUITE_CPU=/tmp/cpu python3 -m pytest -p benchmarks.suite_cpu -n 2 -m "not slurm"
    # then the totals by file and by test function:
    python3 -m benchmarks.suite_cpu /tmp/cpu [--top 30]

Not counted: pytest's own collection, and what runs outside the test's process tree (Slurm jobs under slurmd, the
moto and sshd servers). The suite's budget is CI's wall time on 2 cores; this says which tests spend it.
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import time
from pathlib import Path

import pytest

_out = None


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _out
    if _out is None:
        folder = Path(os.environ.get("NXDT_SUITE_CPU", "suite_cpu"))
        folder.mkdir(parents=True, exist_ok=True)
        _out = open(folder / f"{os.getpid()}.tsv", "a", buffering=1)
    own0, children0 = _cpu()
    start = time.monotonic()
    yield
    own1, children1 = _cpu()
    _out.write(f"{item.nodeid}\t{own1 - own0:.2f}\t{children1 - children0:.2f}\t{time.monotonic() - start:.2f}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    files, functions = collections.Counter(), collections.defaultdict(lambda: [0.0, 0.0, 0])
    for path in args.folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            node, own, children, _ = line.split("\t")
            files[node.split("::")[0]] += float(own) + float(children)
            row = functions[node.split("[")[0]]
            row[0], row[1], row[2] = row[0] + float(own), row[1] + float(children), row[2] + 1
    print(f"{sum(files.values()):.0f} s of CPU in {sum(r[2] for r in functions.values())} tests\n")
    print("by file (s)")
    for name, seconds in files.most_common(args.top):
        print(f"{seconds:8.1f}  {name}")
    print("\nby test function: total (own + children) s, cases")
    for name, (own, children, count) in sorted(functions.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:args.top]:
        print(f"{own + children:8.1f}  ({own:.1f} + {children:.1f})  {count:4d}  {name}")


if __name__ == "__main__":
    main()
