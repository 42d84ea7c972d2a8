"""The host memory a training worker holds before its first tensor: the fixed process overhead the estimator adds
per worker (launcher/estimator/host.py, PROCESS_OVERHEAD_BYTES).

    python -m csp_tools.measure_worker_overhead            # 2 workers, 5 samples each; prints each worker's RSS

It starts two workers the way a job does (python -m runtime.torchrun, which is torch's launcher), each of which
imports torch and the trainer (runtime.train and what it imports), joins a 2-process gloo group, passes a barrier and
then waits, idle. This process reads each worker's resident set (VmRSS in /proc/PID/status) from outside, every
0.1 s for half a second, and prints the largest. Linux only (it reads /proc).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def _worker(ready_dir: Path) -> None:
    """One idle worker: torch, the trainer's modules and a gloo group, then wait to be measured."""
    import torch.distributed as dist

    import runtime.train  # noqa: F401  (what a training worker imports)

    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    (ready_dir / f"{rank}.tmp").write_text(str(os.getpid()))
    (ready_dir / f"{rank}.tmp").rename(ready_dir / f"{rank}.pid")
    while not (ready_dir / "done").exists():
        time.sleep(0.05)
    dist.destroy_process_group()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def measure(workers: int = 2, samples: int = 5, timeout_s: float = 300.0) -> list[int]:
    """Each worker's largest RSS, in bytes, over `samples` readings 0.1 s apart once every worker is ready."""
    with tempfile.TemporaryDirectory() as ready:
        ready_dir = Path(ready)
        command = [sys.executable, "-m", "runtime.torchrun", "--standalone", "--nnodes", "1",
                   "--nproc_per_node", str(workers), "-m", "csp_tools.measure_worker_overhead", "--worker", ready]
        job = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + timeout_s
            while len(list(ready_dir.glob("*.pid"))) < workers:
                if job.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the workers did not start (exit {job.returncode}); run it again with "
                                     "a longer --timeout-s, or see their output above")
                time.sleep(0.1)
            pids = [int((ready_dir / f"{rank}.pid").read_text()) for rank in range(workers)]
            peaks = [0] * workers
            for _ in range(samples):
                peaks = [max(peak, rss_bytes(pid)) for peak, pid in zip(peaks, pids)]
                time.sleep(0.1)
        finally:
            (ready_dir / "done").write_text("")
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="READY_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(Path(args.worker))
        return 0
    peaks = measure(args.workers, args.samples, args.timeout_s)
    for rank, peak in enumerate(peaks):
        print(f"worker {rank}: {peak / GIB:.3f} GiB resident ({peak / 2**20:.0f} MiB), idle in a "
              f"{args.workers}-process gloo group with torch and runtime.train imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
