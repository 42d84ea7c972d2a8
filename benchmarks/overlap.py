"""Communication overlapped with compute: data parallelism (and ZeRO-1) against torch DDP, and pipeline receives,
over a slow link between two pretend nodes.

Two ranks run in two network namespaces joined by veth pairs on a bridge, each side rate limited with `tc tbf`
(tests/cluster_validate/netns.py, as the cluster-validate slow-link test does), gloo over that link, one core and
one intra-op thread per rank. The default model (a 7.3M-parameter GPT, 4 layers x 256, 8192-token vocabulary,
micro-batches of 16 x 512 tokens) and link (100 Mbit/s) make the reduction about as long as the compute, where
overlap matters most. A faster link does not scale down here: at 1 Gbit/s the kernel's veth, bridge and tbf work
takes more CPU time than the model, on the same two cores the ranks compute on, so nothing is left to overlap. Every case trains the same model from the same init on the same batches; a round runs each case for
--steps steps in a rotated order, and a case's figure is the median step time over all its rounds (the first step
of each case in a round is warm-up and not counted).

Data parallelism (dp=2), each with ZeRO-1 off and on:
  ours, overlap          runtime.step.train_step with overlap_grad_reduce / overlap_param_gather (the default)
  ours, no overlap       the same with both off: every bucket reduced after backward
  ours, no reduction     the same step with its collectives replaced by no-ops: the compute alone
  DDP                    torch.nn.parallel.DistributedDataParallel, the same bucket size, fused AdamW
                         (with ZeRO-1: torch's ZeroRedundancyOptimizer over the same AdamW)
  DDP, no reduction      DDP's step under no_sync()
Exposed communication = step time - the same step with no reduction.

Pipeline (pp=2, 1F1B, 4 micro-batches): receives posted early (the default) and not, over the slow link and with
the link unlimited (exposed = the difference).

    sudo python benchmarks/overlap.py [--rate 100mbit] [--layers 4 --hidden 256] [--rounds 3 --steps 3]   # ~25 min
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DP_CASES = ("ours", "ours-no-overlap", "ours-no-reduction", "ddp", "ddp-no-reduction")
PP_CASES = ("pp-early-recv", "pp-late-recv")


def model_config(args):
    from runtime.models import ModelConfig
    return ModelConfig(architecture="gpt", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_attention_heads=args.hidden // 64, ffn_hidden_size=4 * args.hidden,
                       max_position_embeddings=args.seq, share_embeddings_and_output_weights=False)


def batches(args, step: int, rank: int, count: int):
    import torch
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, args.vocab, (count, args.micro_batch, args.seq + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:], None) for t in tokens]


@contextlib.contextmanager
def no_collectives():
    """The collectives a DataParallel step starts, replaced by no-ops (the step's compute alone)."""
    from runtime.parallel import collectives as C
    saved = C.start_all_reduce, C.start_reduce_scatter_flat, C.start_all_gather_flat

    def done(out, *_):
        return C.Pending(None, out, None, ())

    def own_slice(out, full, axis):  # what the rank's shard would hold, unsummed (keeps the norm finite)
        out.copy_(full[axis.rank * out.numel():(axis.rank + 1) * out.numel()])
        return done(out)
    C.start_all_reduce, C.start_reduce_scatter_flat, C.start_all_gather_flat = done, own_slice, done
    try:
        yield
    finally:
        C.start_all_reduce, C.start_reduce_scatter_flat, C.start_all_gather_flat = saved


class Ours:
    def __init__(self, args, zero1: bool, overlap: bool, reduce: bool):
        from runtime.models import build_model
        from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
        import torch
        torch.manual_seed(0)
        self.topo = Topology.build(ParallelDims(tp=1, pp=1, dp=2, world_size=2))
        self.model = parallelize_model(build_model(model_config(args)), self.topo, data_parallel=DataParallelConfig(
            "fp32", zero1, bucket_numel=args.bucket_numel, overlap_grad_reduce=overlap, overlap_param_gather=overlap))
        self.optimizer = ShardedAdamW(self.model, {"lr": 1e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]})
        self.reduce, self.args = reduce, args

    def step(self, step: int) -> None:
        from runtime.step import train_step
        with contextlib.nullcontext() if self.reduce else no_collectives():
            train_step(self.model, self.optimizer, batches(self.args, step, self.topo.dp.rank, self.args.micro_batches),
                       self.topo, lr=1e-4, clip=1.0)


class DDP:
    def __init__(self, args, zero1: bool, reduce: bool):
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        from runtime.models import build_model
        torch.manual_seed(0)
        # The same bucket size as ours, in fp32 MB; the first bucket is as large as the rest (DDP's default is 1 MB).
        mb = args.bucket_numel * 4 / 2 ** 20
        self.model = DistributedDataParallel(build_model(model_config(args)), bucket_cap_mb=mb)
        kwargs = {"lr": 1e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}
        self.optimizer = (ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.AdamW, **kwargs) if zero1
                          else torch.optim.AdamW(self.model.parameters(), **kwargs))
        self.reduce, self.args = reduce, args
        self.rank = torch.distributed.get_rank()

    def step(self, step: int) -> None:
        import torch
        micro = batches(self.args, step, self.rank, self.args.micro_batches)
        count = sum(labels.numel() for _, labels, _ in micro) * 2
        for i, (input_ids, labels, _) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if (last and self.reduce) else self.model.no_sync():
                (self.model(input_ids, labels).sum() / count).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Pipeline:
    def __init__(self, args, early: bool):
        import torch
        from runtime.models import build_model
        from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
        from runtime.parallel.pipeline import p2p
        torch.manual_seed(0)
        self.topo = Topology.build(ParallelDims(tp=1, pp=2, dp=1, world_size=2))
        self.model = parallelize_model(build_model(model_config(args)), self.topo,
                                       data_parallel=DataParallelConfig("fp32"))
        self.optimizer = ShardedAdamW(self.model, {"lr": 1e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]})
        self.early, self.args, self.switch = early, args, p2p.EARLY_RECEIVES_ENV

    def step(self, step: int) -> None:
        from runtime.step import train_step
        os.environ[self.switch] = "1" if self.early else "0"  # train_step reads it at every schedule run
        train_step(self.model, self.optimizer, batches(self.args, step, 0, self.args.pp_micro_batches), self.topo,
                   lr=1e-4, clip=1.0)


def build(case: str, args, zero1: bool):
    if case.startswith("pp-"):
        return Pipeline(args, early=case == "pp-early-recv")
    if case.startswith("ours"):
        return Ours(args, zero1, overlap=case == "ours", reduce=case != "ours-no-reduction")
    return DDP(args, zero1, reduce=case == "ddp")


def worker(args) -> None:
    """One rank: every case, rounds in rotated order; rank 0 prints the step times as JSON."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    cases = [(case, zero1) for zero1 in (False, True) for case in DP_CASES] if args.part == "dp" else \
        [(case, False) for case in PP_CASES]
    times: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for case, zero1 in cases[round_ % len(cases):] + cases[:round_ % len(cases)]:
            runner = build(case, args, zero1)
            for step in range(args.steps + 1):
                dist.barrier()
                start = time.perf_counter()
                runner.step(step)
                dist.barrier()  # a rank's step ends when the slower rank's does
                if step:
                    times.setdefault(f"{case}{'-zero1' if zero1 else ''}", []).append(time.perf_counter() - start)
            del runner
            gc.collect()  # DDP's reducer holds reference cycles: free each case's model before the next
    if args.rank == 0:
        print(json.dumps({name: statistics.median(values) for name, values in times.items()}))
    dist.destroy_process_group()


def run_ranks(args, part: str, rate: str | None) -> dict[str, float]:
    from tests.cluster_validate import netns
    with netns.Bridge(2) as net:
        if rate:
            for i in range(2):
                net.rate_limit(i, rate)
        argv = [a for a in sys.argv[1:]]
        procs = [net.popen(i, ["env", f"GLOO_SOCKET_IFNAME={netns.IFNAME}", "OMP_NUM_THREADS=1",
                               f"PYTHONPATH={REPO}", "taskset", "-c", str(i % (os.cpu_count() or 1)),
                               sys.executable, __file__, *argv, "--worker", "--rank", str(i), "--part", part,
                               "--master", net.address(0)],
                           stdout=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed ({[p.returncode for p in procs]})")
    return json.loads(outs[0].strip().splitlines()[-1])


def report(dp: dict[str, float], pp_slow: dict[str, float], pp_fast: dict[str, float], args) -> None:
    print(f"dp=2 over a {args.rate} link, GPT {args.layers} layers x {args.hidden}, "
          f"{args.micro_batches} micro-batch(es) of {args.micro_batch} x {args.seq}; median step (s)")
    for suffix, title in (("", "data parallel"), ("-zero1", "ZeRO-1")):
        compute_ours, compute_ddp = dp[f"ours-no-reduction{suffix}"], dp[f"ddp-no-reduction{suffix}"]
        print(f"\n{title}")
        print("| case | step (s) | ratio to DDP | exposed communication (s) | exposed / step |")
        print("| --- | --- | --- | --- | --- |")
        for case, compute in (("ours", compute_ours), ("ours-no-overlap", compute_ours), ("ddp", compute_ddp),
                              ("ours-no-reduction", compute_ours), ("ddp-no-reduction", compute_ddp)):
            t = dp[case + suffix]
            print(f"| {case} | {t:.3f} | {t / dp['ddp' + suffix]:.2f} | {t - compute:.3f} | {(t - compute) / t:.0%} |")
    print(f"\npipeline pp=2, 1F1B, {args.pp_micro_batches} micro-batches; median step (s)")
    print(f"| case | {args.rate} link | unlimited link | exposed communication (s) |")
    print("| --- | --- | --- | --- |")
    for case in PP_CASES:
        print(f"| {case} | {pp_slow[case]:.3f} | {pp_fast[case]:.3f} | {pp_slow[case] - pp_fast[case]:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--pp-micro-batches", type=int, default=4)
    parser.add_argument("--bucket-numel", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--parts", default="dp,pp")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    parts = args.parts.split(",")
    dp = run_ranks(args, "dp", args.rate) if "dp" in parts else {}
    pp_slow = run_ranks(args, "pp", args.rate) if "pp" in parts else {}
    pp_fast = run_ranks(args, "pp", None) if "pp" in parts else {}
    print(json.dumps({"dp": dp, "pp_slow": pp_slow, "pp_fast": pp_fast}))
    if dp and pp_slow:
        report(dp, pp_slow, pp_fast, args)


if __name__ == "__main__":
    main()
