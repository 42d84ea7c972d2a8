# A measured fp32 peak for a CPU: the best rate of a matrix multiply over several sizes and repeats, kept per
# machine in a small JSON cache. metrics.py combines it with the theoretical peak from /proc/cpuinfo; see there.
#
# Why several sizes and the best of repeats: one 2048^2 multiply timed once read 0.036-0.155 TFLOP/s under load
# on a CPU where a quiet 4096^2 one reads more, and MFU against that came out at 334%. A rate is only ever
# lowered by interference (other processes, a cold thread pool, first-touch page faults), never raised, so the
# maximum is the figure closest to the truth, and the cache keeps the highest one ever seen for the same reason.
#
#     python -m runtime.peak_probe      # measure again (on a quiet machine) and raise the cached figure
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.io.files import atomic_write_json

SIZES = (1024, 2048, 4096)
REPEATS = 3
# The whole probe's time. A size whose multiplies would not fit in what is left, predicted from the best rate so
# far, is skipped: 4096^2 costs ~0.4 s a multiply on 2 cores and twice that on one.
BUDGET_S = 1.5


@dataclass(frozen=True)
class Probe:
    tflops: float
    size: int  # n of the n x n multiply that gave the best rate


def _timed_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    started = time.perf_counter()
    torch.mm(a, b, out=out)
    return time.perf_counter() - started


def measure(sizes=SIZES, repeats: int = REPEATS, budget_s: float = BUDGET_S, timed_matmul=_timed_matmul) -> Probe:
    """The best fp32 matmul rate over `sizes` (ascending) x `repeats`, within about `budget_s` seconds. The first
    multiply of all pays for starting torch's thread pool; being one of several repeats, it is never the best."""
    best, spent = Probe(0.0, sizes[0]), 0.0
    for n in sizes:
        flops = 2.0 * n**3
        if best.tflops and spent + repeats * flops / (best.tflops * 1e12) > budget_s:
            break
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.zeros(n, n)  # zeros, not empty: its pages are touched before the clock starts
        for _ in range(repeats):
            seconds = timed_matmul(a, b, out)
            spent += seconds
            if flops / seconds / 1e12 > best.tflops:
                best = Probe(flops / seconds / 1e12, n)
    return best


def cache_path(environ=os.environ) -> Path:
    """NXDT_PEAK_CACHE, else nxdt-launch/peak_tflops.json under XDG_CACHE_HOME (~/.cache by default)."""
    if environ.get("NXDT_PEAK_CACHE"):
        return Path(environ["NXDT_PEAK_CACHE"])
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nxdt-launch" / "peak_tflops.json"


def machine_key(cpuinfo: str, threads: int) -> str:
    """What a measured rate depends on: the CPU model, how many threads multiply, and torch's kernels."""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.lower().startswith("model name")), "unknown cpu")
    return f"{model} | {threads} thread{'s' if threads > 1 else ''} | torch {torch.__version__}"


def _read(path: Path) -> dict:
    """The cache's entries; a file that is not a JSON object is ignored (and replaced by the next write)."""
    try:
        entries = json.loads(path.read_text())
        if isinstance(entries, dict):
            return entries
        problem = f"a JSON {type(entries).__name__}, not an object"
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        problem = str(error)
    print(f"warning: {path}: not a peak cache ({problem}); ignoring it", file=sys.stderr, flush=True)
    return {}


def _entry(value) -> Probe | None:
    try:
        probe = Probe(float(value["tflops"]), int(value["size"]))
    except (TypeError, KeyError, ValueError):
        return None
    return probe if math.isfinite(probe.tflops) and probe.tflops > 0 else None


def record(probe: Probe, key: str, path: Path) -> Probe:
    """Keep `probe` under `key` unless the cache already has a higher rate; returns the one kept."""
    return _keep_higher(_read(path), probe, key, path)


def cached_probe(key: str, path: Path) -> Probe:
    """The cached rate for this machine, measuring it first if there is none (once: later runs read it back)."""
    entries = _read(path)
    cached = _entry(entries.get(key))
    return cached if cached is not None else _keep_higher(entries, measure(), key, path)


def _keep_higher(entries: dict, probe: Probe, key: str, path: Path) -> Probe:
    """Atomic, so a crash or a concurrent writer leaves the old file or the new one, never half of one (a
    concurrent writer's entry may be lost, and measured again by a later run)."""
    kept = _entry(entries.get(key))
    if kept is not None and kept.tflops >= probe.tflops:
        return kept
    try:
        atomic_write_json(path, {**entries, key: {"tflops": probe.tflops, "size": probe.size}})
    except OSError as error:  # a read-only home: this run still has its figure
        print(f"warning: {path}: peak cache not written ({error})", file=sys.stderr, flush=True)
    return probe


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""


def main() -> None:
    key, path = machine_key(read_cpuinfo(), torch.get_num_threads()), cache_path()
    measured = measure()
    kept = record(measured, key, path)
    print(f"{key}: measured {measured.tflops:.3f} TFLOP/s at {measured.size}^2; cached {kept.tflops:.3f} "
          f"TFLOP/s at {kept.size}^2 ({path})")


if __name__ == "__main__":
    main()
