# Ring attention: exact causal attention over a sequence split across the context group, with memory per rank
# O(seq / cp). Each rank keeps its queries; the K/V blocks travel round the ring, one hop per step, and each
# block's partial attention is merged into the running output by its log-sum-exp (the online softmax of flash
# attention), so no rank ever holds the whole sequence's keys or an s x s matrix.
#
# Causal load balance (Megatron's layout, runtime/parallel/context.py): the sequence is cut into 2·cp chunks and
# rank r holds chunks r and 2·cp−1−r, one early and one late. Then, for the K/V block of rank s:
#   s == r  both diagonals are causal and the late queries see the early keys: plain causal attention over the
#           rank's own (increasing) positions;
#   s <  r  every query sees rank s's early chunk and none of its late one;
#   s >  r  only the late queries see anything, and they see both of rank s's chunks.
# Every rank does the same work at every step, whatever its place in the ring.
#
# Documents separated inside a row (model.data.reset_attention_mask): every rank has the whole row's document ids
# (runtime/models/layers.py SequenceLayout.context_split), so each block's mask is the layout's above and "same
# document"; a query row may then see no key of some block, whose log-sum-exp is -inf and merges as nothing. Such
# blocks run the spelled-out math with the mask (the fused kernels take only a causal flag).
#
# Backward goes round the ring again: each block's dK/dV accumulate in a buffer that travels with the block and
# arrives back at the block's owner after one more hop. A block's gradients come from the final output and
# log-sum-exp (as in flash attention's backward), so nothing per step is kept from forward.
from __future__ import annotations

import math

import torch

from runtime.models.layers import document_mask
from runtime.parallel import collectives as C
from runtime.parallel.topology import AxisGroup

KV_TAG, GRAD_TAG = 7, 8  # distinct from the pipeline's activation/gradient tags: a rank may be in both


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each KV head for its group of query heads (B, ng, T, d) -> (B, nh, T, d)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of _expand: sum each group's gradients back onto its KV head."""
    if grad.shape[1] == kv_heads:
        return grad
    B, nh, T, d = grad.shape
    return grad.view(B, kv_heads, nh // kv_heads, T, d).sum(dim=2)


def block_attention(q, k, v, causal: bool, scale: float, kernels=None, mask=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, h, Tq, d), log-sum-exp (B, h, Tq) fp32) of softmax(q k^T * scale [+ causal]) v.

    kernels: the device's fused (forward, backward) flash kernels that take and return the log-sum-exp
    (runtime/device.py's flash_attention_kernels: on CPU the one SDPA itself runs, so the single-process model's
    arithmetic); None: the same math spelled out in query tiles.
    """
    if kernels is not None and mask is None:
        return kernels[0](q, k, v, 0.0, causal, scale=scale)
    return math_block_attention(q, k, v, causal, scale, mask)


def block_attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, kernels=None, mask=None):
    """(dq, dk, dv) of one block, given the final output and log-sum-exp of every query row."""
    if kernels is not None and mask is None:
        return kernels[1](grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    return math_block_attention_backward(grad_out, q, k, v, out, lse, causal, scale, mask)


# Query rows per tile in the spelled-out math: the transient score matrix is TILE x keys, not queries x keys.
TILE = 1024


def math_block_attention(q, k, v, causal: bool, scale: float, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    for first in range(0, q.shape[2], TILE):
        scores = _scores(q[:, :, first:first + TILE], k, causal, first, scale, mask)
        lse = torch.logsumexp(scores, dim=-1)
        # A row that sees no key here (another document's block) has lse -inf: its output is 0, its lse kept.
        seen = lse.masked_fill(torch.isinf(lse), 0.0) if mask is not None else lse
        outs.append(torch.matmul(torch.exp(scores - seen.unsqueeze(-1)), v.float()))
        lses.append(lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def math_block_attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    dk, dv, dqs = torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device), []
    kf, vf = k.float(), v.float()
    for first in range(0, q.shape[2], TILE):
        rows = slice(first, first + TILE)
        qf, gf = q[:, :, rows].float(), grad_out[:, :, rows].float()
        probs = torch.exp(_scores(q[:, :, rows], k, causal, first, scale, mask) - lse[:, :, rows].unsqueeze(-1))
        dv += torch.matmul(probs.transpose(-1, -2), gf)
        delta = (gf * out[:, :, rows].float()).sum(dim=-1, keepdim=True)  # rowsum(dO * O) = sum_j P_ij dP_ij
        dscores = probs * (torch.matmul(gf, vf.transpose(-1, -2)) - delta) * scale
        dqs.append(torch.matmul(dscores, kf))
        dk += torch.matmul(dscores.transpose(-1, -2), qf)
    return torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scores(q, k, causal: bool, first: int, scale: float, mask=None) -> torch.Tensor:
    """fp32 q k^T * scale for query rows first.. of the block, with the causal mask (query i sees keys <= i), or
    the block's whole (B, 1, Tq, Tk) `mask` where given."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        return scores.masked_fill(~mask[:, :, first:first + q.shape[2]], float("-inf"))
    if causal:
        query = torch.arange(first, first + q.shape[2], device=q.device).unsqueeze(-1)
        scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device) > query, float("-inf"))
    return scores


def _merge(out, lse, block_out, block_lse):
    """Fold one block's (output, log-sum-exp) into the running ones for the same query rows, in place. Both are
    finite (every row sees at least one key of each block it is given), and spelled out rather than logaddexp,
    which torch-xla runs on the host (a graph break per merge)."""
    top = torch.maximum(lse, block_lse)
    new_lse = top + torch.log(torch.exp(lse - top) + torch.exp(block_lse - top))
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _visible(source: int, rank: int, chunk: int) -> tuple[slice, slice]:
    """(which of this rank's query rows, which of the block's keys) see another rank's K/V block (see top):
    an earlier rank's early chunk is seen by every query, a later rank's whole block by the late queries only."""
    if source < rank:
        return slice(None), slice(None, chunk)
    return slice(chunk, None), slice(None)


class RingAttentionFunction(torch.autograd.Function):
    """q (B, nh, 2c, d), k and v (B, ng, 2c, d): this rank's chunks (r, 2·cp−1−r) in that order; kernels_for:
    tensor -> the device's fused kernels or None (see block_attention)."""

    @staticmethod
    def forward(ctx, q, k, v, axis: AxisGroup, kernels_for, documents=None):
        kernels = kernels_for(q) if kernels_for is not None else None
        rank, size = axis.rank, axis.size
        nh, c = q.shape[1], q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        masks = _document_masks(documents, rank, size, c)
        kv = torch.stack([k, v])
        pending = C.start_ring_pass(kv, axis, KV_TAG) if size > 1 else None
        out, lse = block_attention(q, _expand(k, nh), _expand(v, nh), True, scale, kernels, masks(rank))
        out = out.float()
        for step in range(1, size):
            kv = C.finish_ring_pass(pending)
            if step + 1 < size:
                pending = C.start_ring_pass(kv, axis, KV_TAG)
            source = (rank - step) % size
            bk, bv = _expand(kv[0], nh), _expand(kv[1], nh)
            rows, keys = _visible(source, rank, c)
            block_out, block_lse = block_attention(q[:, :, rows], bk[:, :, keys], bv[:, :, keys], False, scale,
                                                     kernels, masks(source, rows, keys))
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.scale, ctx.kernels, ctx.masks = axis, scale, kernels, masks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        axis, scale, kernels, masks = ctx.axis, ctx.scale, ctx.kernels, ctx.masks
        rank, size = axis.rank, axis.size
        nh, ng, c = q.shape[1], k.shape[1], q.shape[2] // 2
        grad_out = grad_out.contiguous()
        kv = torch.stack([k, v])
        pending = C.start_ring_pass(kv, axis, KV_TAG) if size > 1 else None
        dq, dk, dv = block_attention_backward(grad_out, q, _expand(k, nh), _expand(v, nh), out, lse, True, scale,
                                              kernels, masks(rank))
        dq = dq.float()
        dkv = torch.stack([_fold(dk, ng), _fold(dv, ng)]).float()  # travels with the K/V block it belongs to
        for step in range(1, size):
            kv = C.finish_ring_pass(pending)
            dkv_pending = C.start_ring_pass(dkv, axis, GRAD_TAG)
            if step + 1 < size:
                pending = C.start_ring_pass(kv, axis, KV_TAG)
            source = (rank - step) % size
            bk, bv = _expand(kv[0], nh), _expand(kv[1], nh)
            rows, keys = _visible(source, rank, c)
            bdq, bdk, bdv = block_attention_backward(grad_out[:, :, rows], q[:, :, rows], bk[:, :, keys],
                                                     bv[:, :, keys], out[:, :, rows], lse[:, :, rows], False, scale,
                                                     kernels, masks(source, rows, keys))
            dq[:, :, rows] += bdq
            dkv = C.finish_ring_pass(dkv_pending)  # the block's accumulator, sent on while this rank computed
            dkv[0, :, :, keys] += _fold(bdk, ng)
            dkv[1, :, :, keys] += _fold(bdv, ng)
        if size > 1:  # the buffer in hand is the next rank's block's; ours is one hop behind
            dkv = C.finish_ring_pass(C.start_ring_pass(dkv, axis, GRAD_TAG))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def held_positions(rank: int, size: int, chunk: int) -> torch.Tensor:
    """Where in the row rank `rank`'s tokens sit (see top): chunks rank and 2·size−1−rank of `chunk` tokens."""
    late = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)])


def _document_masks(documents, rank: int, size: int, chunk: int):
    """masks(source, rows, keys): the (B, 1, rows, keys) mask of this rank's queries against rank `source`'s
    block, from the whole row's document ids (None without documents: the plain layout of the top)."""
    if documents is None:
        return lambda source, rows=slice(None), keys=slice(None): None
    where = [held_positions(r, size, chunk).to(documents.device) for r in range(size)]

    def masks(source: int, rows: slice = slice(None), keys: slice = slice(None)):
        return document_mask(documents, where[rank][rows], where[source][keys], causal=source == rank)

    return masks


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: AxisGroup,
                   kernels_for=None, documents: torch.Tensor | None = None) -> torch.Tensor:
    return RingAttentionFunction.apply(q, k, v, axis, kernels_for, documents)
