# Expert parallelism (and tensor parallelism inside the experts) applied to the plain SparseMoE blocks of a model.
# Two exchanges, for the two ways a block batches its experts (runtime/models/moe.py): with a capacity, fixed-size
# batches per expert go out in equal splits; dropless, the sorted assignments go out in runs whose sizes are
# exchanged first.
#
# Experts are shared out over the expert-parallel group (carved out of data parallelism, runtime/parallel/dims.py):
# rank r of an EP group of size e keeps experts [r*E/e, (r+1)*E/e). Each rank routes its own micro-batch exactly
# as one process would (capacity and dropping are decided there, before anything moves), then an all-to-all sends
# every kept assignment to the rank holding its expert and a second one brings the results back; the weighting and
# the sum over top-k slots happen at home. Backward runs the same exchanges with the splits swapped.
#
# Under tensor parallelism every expert's hidden units are split like a dense SwiGLU (gate_up by columns, down by
# rows): the rows entering the experts are identical on the TP ranks (their gradient is summed over TP), and the
# expert outputs are partial sums (summed over TP before they are weighted, so the router's gradient is whole).
# With sequence parallelism the block first gathers the sequence: routing and capacity see the whole micro-batch.
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.moe import SparseMoE
from runtime.parallel import collectives as C
from runtime.parallel import layers as L
from runtime.parallel.plan import Placement, ShardingPlan
from runtime.parallel.topology import AxisGroup, Topology
from runtime.schema import rules


class ExpertParallel:
    """What a SparseMoE calls when its experts are spread over ranks (its `parallel`)."""

    def __init__(self, ep: AxisGroup, tp: AxisGroup, sequence_parallel: bool):
        self.ep, self.tp, self.sequence_parallel = ep, tp, sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return C.gather_sequence_replicated(x, self.tp) if self.sequence_parallel else x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return C.scatter_to_sequence(x, self.tp) if self.sequence_parallel else x

    def enter_experts(self, padded: torch.Tensor) -> torch.Tensor:
        return C.copy_to_region(padded, self.tp)

    def leave_experts(self, out: torch.Tensor) -> torch.Tensor:
        return C.reduce_from_region(out, self.tp)

    def exchange(self, moe: SparseMoE, padded: torch.Tensor) -> torch.Tensor:
        """With a capacity: (E, C, H) batches of this rank's tokens, one per expert -> their outputs. Each EP rank
        sends every other rank the batches of its experts, equal splits of fixed size (no counts to exchange, no
        data-dependent shapes); an expert then runs the ep batches it received as one of ep * C rows.

        Under tensor parallelism the batches are the same on every TP rank, so each carries only its 1/tp of the
        rows across the EP group (the all-to-all volume falls tp-fold) and the TP group puts them together where
        the experts run: rows gathered over TP going in, the outputs' partial sums reduce-scattered coming out
        (instead of summed whole), and the home rows gathered again at the end."""
        ep, tp = self.ep, self.tp
        if ep.size == 1:
            return moe.expert_batches(padded)
        E, cap, H = padded.shape
        local, t = E // ep.size, tp.size
        rows = -(-cap // t)                                                              # per TP rank, per batch
        if t > 1:
            padded = C.scatter_to_sequence(F.pad(padded, (0, 0, 0, rows * t - cap)), tp)  # (E, rows, H), dim 1
        received = C.exchange(padded.reshape(E * rows, H), ep, None, None).view(ep.size * local, rows, H)
        if t > 1:
            received = C.gather_from_sequence(received, tp)                              # (ep * local, t * rows, H)
        width = t * rows
        batch = received.view(ep.size, local, width, H).transpose(0, 1).reshape(local, ep.size * width, H)
        out = moe.expert_batches(batch, summed=t == 1)                                   # partial sums when t > 1
        out = out.view(local, ep.size, width, H).transpose(0, 1).reshape(ep.size * local, width, H)
        if t > 1:
            out = C.reduce_scatter_to_sequence(out.contiguous(), tp)                     # (ep * local, rows, H)
        back = C.exchange(out.reshape(E * rows, H), ep, None, None).view(E, rows, H)
        if t > 1:
            back = C.gather_sequence_replicated(back, tp)[:, :cap]                       # (E, C, H)
        return back

    def dispatch(self, moe: SparseMoE, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Dropless: rows (M, H) sorted by their (global) expert -> each through its expert, in the same order."""
        ep = self.ep
        if ep.size == 1:
            return moe.experts(rows, expert, presorted=True)
        local = moe.num_experts // ep.size
        sent = torch.bincount(expert, minlength=moe.num_experts).view(ep.size, local)  # [r, j]: to rank r's expert j
        got = C.all_to_all(sent.flatten(), ep).view(ep.size, local)                    # [s, j]: from rank s, mine j
        # Split sizes are host integers: one small device-to-host copy per MoE layer and direction.
        send_splits, recv_splits = sent.sum(dim=1).tolist(), got.sum(dim=1).tolist()
        received = C.exchange(rows, ep, recv_splits, send_splits)                      # by source, then expert
        mine = torch.arange(local, device=rows.device).repeat(ep.size).repeat_interleave(got.flatten())
        return C.exchange(moe.experts(received, mine, presorted=False), ep, send_splits, recv_splits)


def apply_expert_parallel(model: nn.Module, topo: Topology, plan: ShardingPlan, *, sequence_parallel: bool) -> None:
    """Keep this rank's experts (and TP slice of each) in every SparseMoE of `model`, install the dispatch, and
    record the experts' placements in `plan`. Parameter names do not change."""
    ep, tp = topo.ep, topo.tp
    for prefix, module in model.named_modules():
        if not isinstance(module, SparseMoE):
            continue
        if problem := rules.ep_divides_experts(ep.size, module.num_experts, "training."):
            raise ValueError(problem)
        local = module.num_experts // ep.size
        experts = torch.arange(ep.rank * local, (ep.rank + 1) * local)
        ffn = module.ffn
        # gate_up's columns: [gate_r | up_r] blocks, or one run of the interleaved gate/up pairs (clamped_swiglu)
        segments = [2 * ffn] if module.expert_activation == "clamped_swiglu" else [ffn, ffn]
        columns = L.shard_rows(segments, tp.rank, tp.size)
        shards = {"gate_up": (2, columns, 2 * ffn), "down": (1, L.shard_rows([ffn], tp.rank, tp.size), ffn)}
        if module.gate_up_bias is not None:  # down_bias stays whole: added once, after the TP sum (models/moe.py)
            shards["gate_up_bias"] = (1, columns, 2 * ffn)
        for name, (dim, rows, full_size) in shards.items():
            kept = getattr(module, name).detach().index_select(0, experts)
            tp_shard = {}
            if tp.size > 1:
                kept = kept.index_select(dim, rows)
                tp_shard = dict(dim=dim, index=rows, full_size=full_size, tp_copies=1)
            setattr(module, name, nn.Parameter(kept.contiguous(), requires_grad=getattr(module, name).requires_grad))
            plan.place(f"{prefix}.{name}", Placement(experts=experts, num_experts=module.num_experts, **tp_shard))
        module.parallel = ExpertParallel(ep, tp, sequence_parallel and tp.size > 1)
