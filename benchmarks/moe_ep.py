"""The all-to-all cost of expert parallelism: forward + backward of one sparse MoE block (runtime/models/moe.py)
on 2 gloo ranks with ep=2 (each rank holds half the experts; runtime/parallel/experts.py sends every assignment
to its expert's rank and brings the result back) against the same block with ep=1 (dp=2: every rank holds every
expert, nothing exchanged), interleaved round by round in one run, same weights and the same tokens per rank.

Every call of runtime.parallel.collectives.all_to_all is wrapped with a timer here: a barrier on the group first
(its time is "waiting": the other rank was still computing, mostly because one rank's experts drew more tokens),
then the all-to-all alone ("transfer"), and the bytes it sent to the other rank. Per step and layer, ep=2 runs five:
the per-expert counts, the tokens out and the results back in forward, and the same two with the splits swapped
in backward. The outputs, the input gradients and the expert gradients are checked equal first (the ep=1 expert
gradients summed over dp, as data parallelism would). Each rank is pinned to its own core with one thread.

    python benchmarks/moe_ep.py [--configs 512/1792/8/2048,512/1792/8/4096,1024/3584/8/2048] [--top-k 2] [--steps 8]
    # about 2.5 minutes on 2 quiet cores; a config is hidden/ffn/experts/tokens per rank
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from runtime.models.moe import SparseMoE  # noqa: E402
from runtime.parallel import collectives as C  # noqa: E402
from runtime.parallel.dims import ParallelDims  # noqa: E402
from runtime.parallel.experts import apply_expert_parallel  # noqa: E402
from runtime.parallel.plan import ShardingPlan  # noqa: E402
from runtime.parallel.topology import Topology, join_world, leave_world  # noqa: E402

RANKS = 2


class TimedAllToAll:
    """Stands in for collectives.all_to_all: barrier (timed as waiting), the all-to-all (timed as transfer), and
    the bytes this rank sent to other ranks. experts.py and AllToAll both look the name up at call time."""

    def __init__(self, inner):
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.waiting = self.transfer = 0.0
        self.sent = self.calls = 0

    def __call__(self, x, axis, out_splits=None, in_splits=None):
        if axis.size == 1:
            return self.inner(x, axis, out_splits, in_splits)
        row_bytes = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        rows = [x.shape[0] // axis.size] * axis.size if in_splits is None else in_splits
        started = time.perf_counter()
        dist.barrier(group=axis.group)
        arrived = time.perf_counter()
        out = self.inner(x, axis, out_splits, in_splits)
        self.waiting += arrived - started
        self.transfer += time.perf_counter() - arrived
        self.sent += (sum(rows) - rows[axis.rank]) * row_bytes
        self.calls += 1
        return out


def _step(block: SparseMoE, x: torch.Tensor) -> float:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()  # as inside a model: the block's input gradient is computed too
    dist.barrier()
    started = time.perf_counter()
    block(x).square().mean().backward()
    return time.perf_counter() - started


def _check(full: SparseMoE, sharded: SparseMoE, x: torch.Tensor, ep_rank: int) -> dict[str, float]:
    """Max |difference| of output, input gradient, router gradient and this rank's expert gradients."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = full(xa), sharded(xb)
    ya.square().mean().backward()
    yb.square().mean().backward()
    local = sharded.gate_up.shape[0]
    mine = slice(ep_rank * local, (ep_rank + 1) * local)
    differences = {"output": ya - yb, "input grad": xa.grad - xb.grad,
                   "router grad": full.router.weight.grad - sharded.router.weight.grad}
    for name in ("gate_up", "down"):
        whole = getattr(full, name).grad.clone()
        dist.all_reduce(whole)  # ep=1 under dp: each expert's gradient is summed over the ranks' tokens
        differences[f"{name} grad"] = whole[mine] - getattr(sharded, name).grad
    result = torch.tensor([d.abs().max().item() for d in differences.values()], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    full.zero_grad(set_to_none=True)
    sharded.zero_grad(set_to_none=True)
    return dict(zip(differences, result.tolist()))


def measure(config: tuple[int, int, int, int], args, topo: Topology, timer: TimedAllToAll) -> dict:
    hidden, ffn, experts, tokens = config
    torch.manual_seed(0)  # the same weights on both ranks
    full = SparseMoE(hidden, ffn, experts, args.top_k).train()
    sharded = copy.deepcopy(full)
    apply_expert_parallel(sharded, topo, ShardingPlan(1), sequence_parallel=False)
    torch.manual_seed(1 + topo.rank)  # each rank its own tokens, as under data parallelism
    x = torch.randn(1, tokens, hidden)
    differences = _check(full, sharded, x, topo.ep.rank)
    worst = max(differences.values())
    assert worst < args.tolerance, f"ep=2 and ep=1 disagree: {differences}"

    rows = []  # per timed round: ep=1 step, ep=2 step, waiting, transfer, bytes sent, all-to-alls
    for step in range(args.steps + 2):  # two warm-up rounds, then alternate which layout goes first
        pair = [("ep1", full), ("ep2", sharded)]
        got = {}
        for name, block in (pair if step % 2 == 0 else pair[::-1]):
            timer.reset()
            got[name] = _step(block, x)
            if name == "ep2":
                got.update(waiting=timer.waiting, transfer=timer.transfer, sent=timer.sent, calls=timer.calls)
        if step >= 2:
            rows.append([got["ep1"], got["ep2"], got["waiting"], got["transfer"], got["sent"], got["calls"]])
    load = sharded.stats["load"].clone()  # this rank's last routing: assignments per (global) expert
    dist.all_reduce(load)
    table = torch.tensor(rows, dtype=torch.float64)
    slowest, mean = table.clone(), table.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(mean)
    mean /= RANKS
    local = experts // topo.ep.size
    shares = load.view(topo.ep.size, local).sum(dim=1).float() / load.sum()
    return {"config": config, "differences": differences, "slowest": slowest.tolist(), "mean": mean.tolist(),
            "busiest share": shares.max().item(), "calls": int(rows[-1][5])}


def rank_main(rank: int, args, store: str, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if hasattr(os, "sched_setaffinity") and RANKS <= (os.cpu_count() or 1):
        os.sched_setaffinity(0, {rank})  # one core per rank
    torch.set_num_threads(1)
    join_world("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=RANKS, world_size=RANKS, ep=RANKS))
    timer = TimedAllToAll(C.all_to_all)
    C.all_to_all = timer
    results = [measure(config, args, topo, timer) for config in args.configs]
    if rank == 0:
        queue.put(results)
    leave_world()


def _config(text: str) -> tuple[int, int, int, int]:
    parts = text.split("/")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"a config is hidden/ffn/experts/tokens, e.g. 512/1792/8/2048; got {text!r}")
    return tuple(int(p) for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="512/1792/8/2048,512/1792/8/4096,1024/3584/8/2048",
                        help="comma-separated hidden/ffn/experts/tokens per rank")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed rounds per config (after two warm-up rounds)")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    args.configs = [_config(c) for c in args.configs.split(",")]
    for hidden, ffn, experts, tokens in args.configs:
        if experts % RANKS:
            parser.error(f"--configs: experts ({experts}) must be divisible by the {RANKS} ranks")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args, f"{tmp}/store", queue), nprocs=RANKS, start_method="spawn")
    results = queue.get()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    elapsed = time.perf_counter() - started
    print(f"# {RANKS} gloo ranks on {os.cpu_count()} CPUs, one core and one thread each, top-{args.top_k}, fp32, "
          f"torch {torch.__version__}; median of {args.steps} interleaved rounds; {elapsed:.0f} s, "
          f"load average {load:.2f} at the end")
    for result in results:
        worst = ", ".join(f"{name} {value:.1e}" for name, value in result["differences"].items())
        print(f"# {'/'.join(map(str, result['config']))}: ep=2 against ep=1, max |difference|: {worst}; "
              f"{result['calls']} all-to-alls per ep=2 step")
    print()
    print("| hidden / ffn / experts / tokens per rank | ep=1 tokens/s per rank | ep=2 tokens/s per rank | "
          "ep=2 / ep=1 step time, paired median (min-max) | all-to-all per step (ms): transfer, waiting | "
          "share of the ep=2 step: transfer, waiting | sent to the other rank per step (MB; bytes per token) | "
          "all-to-all GB/s | busiest rank's share of the assignments |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        hidden, ffn, experts, tokens = result["config"]
        slowest, mean = result["slowest"], result["mean"]  # rounds x [ep1, ep2, waiting, transfer, sent, calls]
        ep1 = statistics.median(r[0] for r in slowest)  # a data-parallel step ends when its slowest rank does
        ep2 = statistics.median(r[1] for r in slowest)
        ratios = [r[1] / r[0] for r in slowest]
        waiting = statistics.median(r[2] for r in mean)
        transfer = statistics.median(r[3] for r in mean)
        sent = statistics.median(r[4] for r in mean)
        gbps = statistics.median(r[4] / r[3] for r in mean) / 1e9
        print(f"| {hidden} / {ffn} / {experts} / {tokens} | {tokens / ep1:,.0f} | {tokens / ep2:,.0f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{transfer * 1e3:.1f}, {waiting * 1e3:.1f} | {transfer / ep2:.1%}, {waiting / ep2:.1%} | "
              f"{sent / 1e6:.2f}; {sent / tokens:,.0f} | {gbps:.2f} | {result['busiest share']:.3f} |")


if __name__ == "__main__":
    main()
