# Tensor-parallel replacements for the model's leaves, each built FROM the full module by slicing: on the meta
# device (training: only shapes are sliced, and runtime/models/init.py materializes this rank's part afterwards)
# or with values (a built model), so a sharded model starts from exactly the weights of the unsharded one.
#
# Each layer declares where its parameters sit in the unsharded model in `placements` (local name -> Placement);
# parallelize collects them into the model's ShardingPlan (runtime/parallel/plan.py), which is what data
# parallelism, checkpoints and the full-state gather read.
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.layers import cross_entropy
from runtime.models.lora import LoRA
from runtime.parallel import collectives as C
from runtime.parallel.plan import Placement
from runtime.parallel.topology import AxisGroup


def shard_rows(sizes: Sequence[int], rank: int, size: int) -> torch.Tensor:
    """Row indices of rank's share of a fused weight made of consecutive segments of `sizes` rows.

    E.g. SwiGLU's [gate | up]: rank r takes its chunk of gate and its chunk of up, so the local weight is again
    laid out [gate_r | up_r] and the module's forward (which splits in two) works unchanged.
    """
    rows, start = [], 0
    for n in sizes:
        assert n % size == 0, (sizes, size)
        chunk = n // size
        rows.append(torch.arange(start + rank * chunk, start + (rank + 1) * chunk))
        start += n
    return torch.cat(rows)


def _param_from(full: torch.Tensor, index: torch.Tensor, dim: int, *, copies: int = 1,
                source: str | None = None) -> tuple[nn.Parameter, Placement]:
    """Rows `index` of `full` along `dim` as a new parameter, and its placement (held by `copies` TP ranks)."""
    # A frozen weight (the base of a LoRA model) stays frozen in its shards.
    param = nn.Parameter(full.detach().index_select(dim, index).contiguous(), requires_grad=full.requires_grad)
    return param, Placement(dim=dim, index=index, full_size=full.shape[dim], tp_copies=copies, source=source)


def column_parallel_lora(lora: LoRA | None, axis: AxisGroup,
                         replicated: dict[str, tuple[torch.Tensor, int]] | None = None) -> LoRA | None:
    """The adapters of a column-parallel layer: B_t keeps this rank's chunk of target t's output rows (the same
    rows as the base weight's segment), A_t is whole on every rank. A's gradient on one rank covers only that
    rank's output rows, so it is marked partial: summed over TP.

    replicated: segments this rank holds whole rather than a 1/tp chunk of, as target -> (the rows of the full B,
    how many TP ranks hold the same rows): a replicated KV head's k and v. Their B rows are then that head's own,
    one adapter per real KV head, which the head's copies share (the layer sums their gradients, as for the base)."""
    if lora is None:
        return None
    replicated = replicated or {}
    A, B, placements = {}, {}, {}
    for target, param in lora.B.items():
        index, copies = replicated.get(target, (shard_rows([param.shape[0]], axis.rank, axis.size), 1))
        B[target], placements[f"B.{target}"] = _param_from(param, index, 0, copies=copies)
        A[target] = lora.A[target].detach().clone()
        placements[f"A.{target}"] = Placement(partial_grad=True)
    segments = [(t, len(replicated[t][0]) if t in replicated else rows // axis.size) for t, rows in lora.segments]
    sharded = LoRA(segments, {t: a.data for t, a in A.items()}, {t: b.data for t, b in B.items()}, lora.scale, 0.0)
    sharded.dropout, sharded.placements, sharded.seed = lora.dropout, placements, lora.seed
    return sharded


def row_parallel_lora(lora: LoRA | None, axis: AxisGroup) -> LoRA | None:
    """The adapters of a row-parallel layer: A_t keeps this rank's input columns, B_t is whole. The delta is
    added to the partial sum before the reduction, so B's gradient on one rank is partial: summed over TP."""
    if lora is None:
        return None
    A, B, placements = {}, {}, {}
    for target, param in lora.A.items():
        index = shard_rows([param.shape[1]], axis.rank, axis.size)
        A[target], placements[f"A.{target}"] = _param_from(param, index, 1)
        B[target] = lora.B[target].detach().clone()
        placements[f"B.{target}"] = Placement(partial_grad=True)
    sharded = LoRA(lora.segments, {t: a.data for t, a in A.items()}, {t: b.data for t, b in B.items()},
                   lora.scale, 0.0)
    sharded.dropout, sharded.placements, sharded.seed = lora.dropout, placements, lora.seed
    return sharded


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: rank i computes Y_i = X A_i^T + b_i (its output columns).

    Input: replicated X (copy_to_region), or a sequence shard under sequence parallelism (all-gathered first).
    Output: this rank's columns, (B, T, out/t), which feed a RowParallelLinear or the vocab-parallel loss.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, axis: AxisGroup, sequence_parallel: bool,
                 placements: dict[str, Placement]):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.placements = dict(placements)
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.lora: LoRA | None = None  # adapters (runtime/models/lora.py), sharded by column_parallel_lora

    @classmethod
    def from_linear(cls, linear: nn.Linear, axis: AxisGroup, *, sequence_parallel: bool,
                    rows: torch.Tensor | None = None) -> "ColumnParallelLinear":
        if rows is None:
            rows = shard_rows([linear.out_features], axis.rank, axis.size)
        placements = {}
        weight, placements["weight"] = _param_from(linear.weight, rows, 0)
        bias = None
        if linear.bias is not None:
            bias, placements["bias"] = _param_from(linear.bias, rows, 0)
        layer = cls(weight, bias, axis, sequence_parallel, placements)
        layer.lora = column_parallel_lora(getattr(linear, "lora", None), axis)
        return layer

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return C.gather_from_sequence(x, self.axis)  # (B, T/t, H) -> (B, T, H)
        return C.copy_to_region(x, self.axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input(x)
        y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class _SumOverReplicas(torch.autograd.Function):
    """Forward W = W; backward dW = sum of dW over the TP ranks that hold the same replica.

    Ranks sharing a KV head each see only the gradient from their own query heads. Instead of a process group per
    replica set, every rank drops its dW into slot `slot` of a zero buffer with one slot per distinct replica,
    all-reduces that over TP and reads its slot back: slot s then holds the sum over exactly the ranks in set s.
    """

    @staticmethod
    def forward(ctx, weight, axis, slot, num_slots):
        ctx.axis, ctx.slot, ctx.num_slots = axis, slot, num_slots
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        buffer = grad.new_zeros((ctx.num_slots, *grad.shape))  # (slots, rows, H)
        buffer[ctx.slot] = grad
        C.all_reduce(buffer, ctx.axis)
        return buffer[ctx.slot], None, None, None


class ReplicatedKVColumnParallelLinear(ColumnParallelLinear):
    """Fused QKV when tp exceeds the number of KV heads (like NxD's kv_replicator).

    Queries are split as usual (nh/t heads per rank); each rank keeps a copy of the one KV head its queries use,
    so tp/ng ranks hold the same K/V rows. Those rows live in their own parameter (`kv_weight`) because they are
    replicated, not sharded: their gradients are summed over the replica set and counted once in the grad norm.
    LoRA adapters on k and v follow the same rule: B_k and B_v keep the head's rows of the real heads' adapter,
    their gradients summed over the copies, so the copies stay one adapter and a checkpoint or export holds each
    real head's once; A_k and A_v are whole on every rank, their gradients summed over TP as in any column layer.
    """

    def __init__(self, linear: nn.Linear, axis: AxisGroup, *, sequence_parallel: bool, num_heads: int,
                 num_kv_heads: int, head_dim: int):
        assert axis.size % num_kv_heads == 0 and num_heads % axis.size == 0, (num_heads, num_kv_heads, axis.size)
        q_rows = shard_rows([num_heads * head_dim], axis.rank, axis.size)
        kv_slot = axis.rank * num_kv_heads // axis.size  # the KV head this rank's query heads attend with
        k_start = num_heads * head_dim + kv_slot * head_dim
        v_start = k_start + num_kv_heads * head_dim
        kv_rows = torch.cat([torch.arange(k_start, k_start + head_dim), torch.arange(v_start, v_start + head_dim)])
        placements = {}
        weight, placements["weight"] = _param_from(linear.weight, q_rows, 0)
        bias = None
        if linear.bias is not None:
            bias, placements["bias"] = _param_from(linear.bias, q_rows, 0)
        replicas = axis.size // num_kv_heads
        kv_weight, placements["kv_weight"] = _param_from(linear.weight, kv_rows, 0, copies=replicas, source="weight")
        kv_bias = None
        if linear.bias is not None:
            kv_bias, placements["kv_bias"] = _param_from(linear.bias, kv_rows, 0, copies=replicas, source="bias")
        super().__init__(weight, bias, axis, sequence_parallel, placements)
        self.kv_slot, self.num_kv_slots = kv_slot, num_kv_heads
        self.kv_weight, self.kv_bias = kv_weight, kv_bias
        head = torch.arange(kv_slot * head_dim, (kv_slot + 1) * head_dim)  # the head's rows of the full B_k, B_v
        self.lora = column_parallel_lora(getattr(linear, "lora", None), axis,
                                         {"k_proj": (head, replicas), "v_proj": (head, replicas)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sync = lambda w: _SumOverReplicas.apply(w, self.axis, self.kv_slot, self.num_kv_slots)
        weight = torch.cat([self.weight, sync(self.kv_weight)])  # rows [q_r | k_g | v_g]
        bias = torch.cat([self.bias, sync(self.kv_bias)]) if self.bias is not None else None
        x = self._input(x)
        y = F.linear(x, weight, bias)
        if self.lora is None:
            return y
        return self.lora(x, y, {t: sync(b) for t, b in self.lora.B.items() if t in ("k_proj", "v_proj")})


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: rank i holds A_i and the matching input columns X_i;
    Y = sum_i X_i A_i^T (all-reduce, or reduce-scatter onto sequence shards), then + b once.

    Under sequence parallelism the replicated bias is added to a sequence shard, so its gradient is partial.
    """

    def __init__(self, linear: nn.Linear, axis: AxisGroup, *, sequence_parallel: bool):
        super().__init__()
        cols = shard_rows([linear.in_features], axis.rank, axis.size)
        self.placements = {}
        self.weight, self.placements["weight"] = _param_from(linear.weight, cols, 1)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad) \
            if linear.bias is not None else None
        if self.bias is not None and sequence_parallel:
            self.placements["bias"] = Placement(partial_grad=True)
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.lora = row_parallel_lora(getattr(linear, "lora", None), axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (B, T, out), a partial sum
        if self.lora is not None:
            partial = self.lora(x, partial)  # its delta is partial too: reduced with the base
        if self.sequence_parallel:
            y = C.reduce_scatter_to_sequence(partial, self.axis)  # (B, T/t, out)
        else:
            y = C.reduce_from_region(partial, self.axis)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary: rank i owns ids [i*V/t, (i+1)*V/t), looks those up, writes zeros for
    the rest, and the all-reduce assembles the full (replicated) embedding."""

    def __init__(self, embedding: nn.Embedding, axis: AxisGroup):
        super().__init__()
        rows = shard_rows([embedding.num_embeddings], axis.rank, axis.size)
        self.placements = {}
        self.weight, self.placements["weight"] = _param_from(embedding.weight, rows, 0)
        self.vocab_start = axis.rank * self.weight.shape[0]
        self.axis = axis
        self.sparse = False  # like nn.Embedding.sparse; data parallelism turns it on

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight, sparse=self.sparse)  # (B, T, H)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return C.reduce_from_region(h, self.axis)


class _ShardedVocabulary:
    """The `reduce` for runtime.models.layers.cross_entropy when the vocabulary is split over TP ranks.

    With z's vocabulary split: the global max m is an all-reduce MAX of the shard maxima, and sum_v exp(z - m)
    and z_label (non-zero on the one rank owning the label) are all-reduce SUMs, done as one (2, N) collective.
    The backward needs no communication: each rank's slice of softmax - onehot is local.
    """

    def __init__(self, axis: AxisGroup, vocab_start: int):
        self.axis, self.vocab_start = axis, vocab_start

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return C.all_reduce(x, self.axis, op=C.MAX)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return C.all_reduce(x, self.axis)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, axis: AxisGroup,
                                 padding_from: int | None = None) -> torch.Tensor:
    """(..., V/t) local logits and (...) labels -> (...) per-token loss, equal to F.cross_entropy on the full V
    (on its first padding_from entries when the vocabulary is padded: each rank masks its own padded columns).

    Like the unsharded version it overwrites fp32 logits in place.
    """
    return cross_entropy(logits, labels, _ShardedVocabulary(axis, axis.rank * logits.shape[-1]), padding_from)


class VocabParallelCrossEntropy(nn.Module):
    def __init__(self, axis: AxisGroup, padding_from: int | None = None):
        super().__init__()
        self.axis, self.padding_from = axis, padding_from

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.axis, self.padding_from)


class GatherFromRegion(nn.Module):
    """(B, T, V/t) logits shards -> full (B, T, V) on every rank, for callers that want real logits."""

    def __init__(self, axis: AxisGroup):
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return C.gather_from_region(x, self.axis)


class ScatterToSequence(nn.Module):
    def __init__(self, axis: AxisGroup):
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return C.scatter_to_sequence(x, self.axis)
