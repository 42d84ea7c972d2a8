"""busbw measured by cluster-validate's collective loop (csp_tools/cluster_validate/measure.py) next to a bare
torch.distributed timing loop of the same operation and size, in the same processes and the same run, and the
memory-copy bandwidth of this host (the single-host limit for a CPU collective) at the same size, measured by
rank 0 alone between trials (the best trial: a limit is what the host can do undisturbed).

Each trial runs three loops back to back, in rotating order: ours, the bare loop, and the bare loop again. The
table gives the median busbw of ours and of the bare loop, the median of the per-trial ratios ours / bare (1.00:
the harness adds nothing to what it measures), and the same for bare again / bare: the noise floor of this
machine in this run, which is what a deviation of ours / bare from 1.00 has to be read against. Each rank is
pinned to its own core with one thread, so the loops compared are not disturbed by migrations.

    python benchmarks/collectives.py [--ranks 2] [--sizes 4M] [--trials 101] [--iters 20]   # about 2.5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from csp_tools.cluster_validate.bandwidth import OPERATIONS, aligned_size, bus_factor  # noqa: E402
from csp_tools.cluster_validate.config import parse_size  # noqa: E402
from csp_tools.cluster_validate.measure import measure_operation  # noqa: E402

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bare_busbw(op: str, size: int, warmup: int, iters: int) -> float:
    """The reference: buffers, a barrier, a loop of the plain call, the rank-mean time. Nothing else."""
    n = dist.get_world_size()
    count = size // 4
    if op in ("all_reduce", "broadcast"):
        buf = torch.ones(count)
        call = (lambda: dist.all_reduce(buf)) if op == "all_reduce" else (lambda: dist.broadcast(buf, 0))
    elif op == "all_gather":
        inp, out = torch.ones(count // n), torch.empty(count)
        call = lambda: _gather(out, inp)  # noqa: E731
    elif op == "reduce_scatter":
        inp, out = torch.ones(count), torch.empty(count // n)
        call = lambda: _scatter(out, inp)  # noqa: E731
    else:
        inp, out = torch.ones(count), torch.empty(count)
        call = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
    for _ in range(warmup):
        call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed)
    return size / (elapsed.item() / n) / 1e9 * bus_factor(op, n)


def memcpy_gbps(size: int, iters: int) -> float:
    src, dst = torch.ones(size // 4), torch.empty(size // 4)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    return size * iters / (time.perf_counter() - start) / 1e9


def rank_main(rank: int, ranks: int, store: str, args, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if hasattr(os, "sched_setaffinity") and ranks <= (os.cpu_count() or 1):
        os.sched_setaffinity(0, {rank})  # one core per rank: no migrations between the loops being compared
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    rows = []
    for size in args.sizes:
        for op in OPERATIONS:
            size_op = aligned_size(op, size, ranks, 4)
            loops = {
                "ours": lambda: measure_operation(op, size_op, warmup=args.warmup, iters=args.iters).busbw,
                "bare": lambda: bare_busbw(op, size_op, args.warmup, args.iters),
                "bare again": lambda: bare_busbw(op, size_op, args.warmup, args.iters),
            }
            got: dict[str, list[float]] = {name: [] for name in loops}
            copy = []
            for trial in range(args.trials):
                names = list(loops)
                for name in names[trial % 3:] + names[:trial % 3]:  # rotate: no loop always runs first
                    got[name].append(loops[name]())
                if rank == 0:  # alone, while the other ranks wait: a limit is measured undisturbed
                    copy.append(memcpy_gbps(size_op, args.iters))
                dist.barrier()

            def paired(a: str, b: str) -> float:
                return statistics.median(x / y for x, y in zip(got[a], got[b]))

            rows.append((op, size_op, statistics.median(got["ours"]), statistics.median(got["bare"]),
                         paired("ours", "bare"), paired("bare again", "bare"), max(copy, default=0.0)))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", default="4M")
    parser.add_argument("--trials", type=int, default=101)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args.ranks, f"{tmp}/store", args, queue), nprocs=args.ranks,
                           start_method="spawn")
    rows = queue.get()
    print(f"gloo on this host, {args.ranks} ranks, {os.cpu_count()} CPUs; median of {args.trials} trials of "
          f"{args.iters} iterations each\n")
    print("| operation | size (B) | busbw, cluster-validate (GB/s) | busbw, bare loop (GB/s) | ours / bare | "
          "bare / bare (noise floor) | memcpy (GB/s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for op, size, ours, bare, ratio, noise, copy in rows:
        print(f"| {op} | {size} | {ours:.3f} | {bare:.3f} | {ratio:.3f} | {noise:.3f} | {copy:.2f} |")


if __name__ == "__main__":
    main()
