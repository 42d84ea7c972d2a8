# Long context: each sequence split over the context group (Topology.cp, carved out of data parallelism), so every
# activation of a layer holds seq / cp tokens per rank. Two ways to attend across the split:
#   ring     context parallelism (model.context_parallel_size): K/V blocks go round the group
#            (runtime/parallel/ring_attention.py); rank r holds sequence chunks r and 2·cp−1−r (load balance).
#   ulysses  DeepSpeed-Ulysses (model.ulysses_parallel_size): an all-to-all turns the sequence split into a head
#            split for core attention (the whole sequence, heads / u of them) and a second one turns it back;
#            rank r holds the r-th contiguous chunk.
# The data loader hands each rank only its tokens (sequence_index), positions (RoPE, learned) follow the tokens
# (separated documents: the whole row's positions and document ids travel in the layout, and each attention masks
# by them), and the loss needs nothing: step.py sums per-token losses over the DP group, which contains the context group,
# and divides by the global token count, so the mean is over the same tokens as in one process.
from __future__ import annotations

import torch
from torch import nn

from runtime.models.layers import CoreAttention, RotaryEmbedding, document_mask
from runtime.models.transformer import CausalLM, Embeddings
from runtime.parallel import collectives as C
from runtime.parallel.ring_attention import held_positions, ring_attention
from runtime.parallel.topology import AxisGroup

KINDS = ("ring", "ulysses")


def sequence_index(seq_length: int, rank: int, size: int, kind: str) -> torch.Tensor:
    """Positions in the full sequence of the tokens context rank `rank` holds, in the order it holds them."""
    assert kind in KINDS, kind
    if kind == "ulysses":
        chunk = seq_length // size
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    return held_positions(rank, size, seq_length // (2 * size))


class ContextPositions:
    """What Embeddings and RotaryEmbedding call for the positions of a rank's tokens (`positions(T, device)`,
    T the rank's token count); derived from the layout, so no extra tensor travels with the batch or between
    pipeline stages."""

    def __init__(self, axis: AxisGroup, kind: str):
        self.rank, self.size, self.kind = axis.rank, axis.size, kind
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, local_length: int, device: torch.device) -> torch.Tensor:
        key = (local_length, device)
        if key not in self._cache:
            self._cache[key] = sequence_index(local_length * self.size, self.rank, self.size, self.kind).to(device)
        return self._cache[key]

    def rotary_tables(self, rotary: RotaryEmbedding, local_length: int, device: torch.device):
        """RoPE's (cos, sin) rows at the rank's positions, gathered once and shared by every layer with the same
        tables: each layer's rotation keeps its tables for backward, and a gather per layer and micro-batch would
        keep that many copies (one process keeps views of the buffers instead)."""
        key = ("rope", local_length, device, rotary.head_dim, rotary.max_positions, rotary.base, rotary.scaling)
        if key not in self._cache:
            where = self(local_length, device)
            self._cache[key] = (rotary.cos[where, None, :], rotary.sin[where, None, :])
        return self._cache[key]


class RingAttention(nn.Module):
    """CoreAttention's replacement under context parallelism (same inputs: q (B, nh, T/cp, d), k and v
    (B, ng, T/cp, d); same output). Its own module, so selective recompute can still target it."""

    def __init__(self, axis: AxisGroup, kernels_for=None):
        super().__init__()
        self.axis, self.kernels_for = axis, kernels_for

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
                ) -> torch.Tensor:
        return ring_attention(q, k, v, self.axis, self.kernels_for, documents)


class UlyssesAttention(nn.Module):
    """Wraps CoreAttention: sequence-split (B, h, T/u, d) in, head-split (B, h/u, T, d) through the unchanged
    core attention, sequence-split out. KV heads that do not split u ways are repeated to one per query head
    first (GQA kept where they do)."""

    def __init__(self, inner: CoreAttention, axis: AxisGroup):
        super().__init__()
        self.inner, self.axis = inner, axis

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
                ) -> torch.Tensor:
        u, heads = self.axis.size, q.shape[1]
        if k.shape[1] % u:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        q, k, v = (_sequence_to_heads(x, self.axis) for x in (q, k, v))
        mask = None
        if documents is not None:  # the whole row, in order: the documents' causal mask as one process has it
            index = torch.arange(documents.shape[1], device=documents.device)
            mask = document_mask(documents, index, index, causal=True)
        return _heads_to_sequence(self.inner(q, k, v) if mask is None else self.inner(q, k, v, mask), self.axis)


def _sequence_to_heads(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """(B, h, t, d) holding sequence chunk r -> (B, h/u, u·t, d) holding head group r, whole sequence."""
    u = axis.size
    B, h, t, d = x.shape
    parts = x.reshape(B, u, h // u, t, d).transpose(0, 1)            # (u, B, h/u, t, d): head group j for rank j
    got = C.exchange(parts.contiguous(), axis, None, None)           # (u, B, h/u, t, d): chunk i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(B, h // u, u * t, d)


def _heads_to_sequence(y: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """The inverse: (B, h/u, u·t, d) -> (B, h, t, d)."""
    u = axis.size
    B, g, T, d = y.shape
    parts = y.reshape(B, g, u, T // u, d).permute(2, 0, 1, 3, 4)     # (u, B, h/u, t, d): chunk j for rank j
    got = C.exchange(parts.contiguous(), axis, None, None)           # (u, B, h/u, t, d): head group i from rank i
    return got.transpose(0, 1).reshape(B, g * u, T // u, d)


def apply_context_parallel(model: CausalLM, axis: AxisGroup, kind: str, attention_kernels=None) -> None:
    """Make `model` attend across its context group and take positions from the layout (in place).
    attention_kernels: runtime.device.flash_attention_kernels, the fused kernels ring attention runs its blocks
    with where the device has them (passed in: this package cannot import the device module)."""
    assert kind in KINDS, kind
    positions = ContextPositions(axis, kind)
    for module in model.modules():
        if isinstance(module, (Embeddings, RotaryEmbedding)):
            module.positions = positions
    for block in model.layers:
        core = block.attn.core_attention
        block.attn.core_attention = RingAttention(axis, attention_kernels) if kind == "ring" else UlyssesAttention(core, axis)
