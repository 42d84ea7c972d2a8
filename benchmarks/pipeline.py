"""Pipeline schedules measured: the bubble (idle fraction of each rank) against the theory (p - 1) / (m + p - 1),
and the peak activation memory per stage, for 1F1B against all-forward-all-backward (GPipe), plus interleaved
1F1B with its (p - 1) / (vpp * m + p - 1).

The ranks run the real schedules, executor and gloo point-to-point on a tiny GPT split into stages. Because this
host may have fewer cores than ranks, each transformer layer also sleeps a fixed time in forward (and twice that
in backward), so a pass costs about the same on every rank whatever the core count: the measured bubble is then
the schedule's, not the CPU contention's. Busy time is each pass's compute (receives excluded); a rank's idle
fraction is 1 - busy / (end of the last rank - start of the first), averaged over ranks, best of --trials.
Peak activation memory is the most bytes autograd held saved for backward at once on that rank (saved-tensor
hooks; tensors shared between saves are counted once per save), with the sleeps switched off.

    python benchmarks/pipeline.py [--pp 4] [--micro-batches 4 8 16] [--layer-ms 10] [--trials 2]   # ~1 minute
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from runtime.micro_batch import MicroBatch  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.parallel import ParallelDims, Topology, parallelize_model  # noqa: E402
from runtime.parallel.pipeline import run_pipeline  # noqa: E402

SEQ, MICRO_BATCH, HIDDEN = 64, 2, 64


class _Sleep(torch.autograd.Function):
    """Identity that costs `seconds` in forward and twice that in backward (a layer's simulated compute)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class _SavedBytes:
    """Live bytes autograd keeps saved for backward on this rank, and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, tensor):
        return _Held(self, tensor)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, counter: _SavedBytes, tensor: torch.Tensor):
        self.counter, self.tensor, self.nbytes = counter, tensor, tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.nbytes


def _stage(pp: int, vpp: int, layer_s: float):
    cfg = ModelConfig(architecture="gpt", vocab_size=256, hidden_size=HIDDEN, num_layers=2 * pp,
                      num_attention_heads=4, ffn_hidden_size=4 * HIDDEN, max_position_embeddings=SEQ,
                      share_embeddings_and_output_weights=False)
    topo = Topology.build(ParallelDims(tp=1, pp=pp, dp=1, world_size=pp))
    stage = parallelize_model(build_model(cfg), topo, virtual_pp=vpp if vpp > 1 else None)
    if layer_s:
        for block in stage.layers.values():
            block.register_forward_hook(lambda _m, _args, out: _Sleep.apply(out, layer_s))
    return stage, topo, cfg


def _batches(m: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (m, MICRO_BATCH, SEQ + 1), generator=gen)
    return [MicroBatch(t[:, :-1], t[:, 1:], torch.ones(MICRO_BATCH, SEQ)).prepare() for t in tokens]


def _measure(pp: int, vpp: int, schedule: str, m: int, layer_s: float, trials: int) -> dict:
    stage, topo, cfg = _stage(pp, vpp, layer_s)
    batches = _batches(m, cfg.vocab_size)
    best = None
    for _ in range(trials):
        timeline: list = []
        dist.barrier()
        run_pipeline(stage, batches, topo, float(m * MICRO_BATCH * SEQ), forward_only=False, schedule=schedule,
                     timeline=timeline)
        for p in stage.parameters():
            p.grad = None
        busy = sum(end - start for _, start, end in timeline)
        span = torch.tensor([-timeline[0][1], timeline[-1][2]], dtype=torch.float64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # earliest start (negated) and latest end over the ranks
        idle = torch.tensor([1.0 - busy / (span[0] + span[1]).item()], dtype=torch.float64)
        dist.all_reduce(idle)
        idle = idle.item() / pp
        best = idle if best is None else min(best, idle)
    stage, topo, _ = _stage(pp, vpp, 0.0)  # memory: no sleeps needed
    saved = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        run_pipeline(stage, batches, topo, float(m * MICRO_BATCH * SEQ), forward_only=False, schedule=schedule)
    peaks = [None] * pp
    dist.all_gather_object(peaks, (saved.peak, stage.peak_in_flight))
    return {"idle": best, "peak_bytes": [p for p, _ in peaks], "in_flight": [n for _, n in peaks]}


def _worker(rank: int, pp: int, tmp: str, cases, layer_s: float, trials: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=pp)
    try:
        rows = [(case, _measure(pp, case[0], case[1], case[2], layer_s, trials)) for case in cases]
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--layer-ms", type=float, default=10.0)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    pp = args.pp
    cases = []
    for m in args.micro_batches:
        cases += [(1, "all_forward_all_backward", m), (1, "1f1b", m)]
        if m % pp == 0:
            cases.append((2, "interleaved", m))
    with tempfile.TemporaryDirectory(prefix="nxdt_pipe_bench_") as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(pp, tmp, cases, args.layer_ms / 1000, args.trials, out), nprocs=pp, join=True)
        rows = torch.load(out, weights_only=False)
    print(f"pp={pp}, {2 * pp} layers of hidden {HIDDEN} (2 per rank: 1 per chunk with vpp=2), "
          f"micro-batch {MICRO_BATCH} x seq {SEQ}, {args.layer_ms:g} ms simulated forward per layer "
          f"(x2 backward)\n")
    print("| schedule | vpp | m | bubble measured | bubble theory | peak saved activations per stage (KiB) "
          "| micro-batches in flight per stage |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (vpp, schedule, m), row in rows:
        theory = (pp - 1) / (vpp * m + pp - 1)
        kib = " / ".join(f"{b / 1024:.0f}" for b in row["peak_bytes"])
        flight = " / ".join(str(n) for n in row["in_flight"])
        print(f"| {schedule} | {vpp} | {m} | {row['idle']:.3f} | {theory:.3f} | {kib} | {flight} |")


if __name__ == "__main__":
    main()
