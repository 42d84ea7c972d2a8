# Collectives over torch.distributed only (gloo, nccl and xla all implement these), and Megatron-style
# mappings: each collective paired with its adjoint as a tiny autograd.Function.
#
# Notation: a TP group of size t; X is replicated on every rank, X_i is rank i's part. For sequence parallelism
# activations are (B, T, H) and rank i holds the sequence shard X[:, i*T/t:(i+1)*T/t].
# Every helper is a no-op on a group of size 1, so the single-process path pays nothing.
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from runtime.parallel.topology import AxisGroup, needs_host_staging

SEQUENCE_DIM = 1  # activations are (B, T, H)

# torch 2.13 renamed the tensor-in/tensor-out collectives; older torch (and torch-xla's pin) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _on_host(collective, out: torch.Tensor, inp: torch.Tensor | None, group, **kwargs) -> None:
    """Run `collective(out[, inp], group=...)`, through host copies when the group's backend cannot address the
    tensors' device: gloo over XLA tensors, as the XLA:CPU tests run (see runtime/device.py). A capability check,
    not a device switch: on gloo with CPU tensors, nccl and xla, this is a plain call."""
    host_out, host_in = _staged(out, inp, group)
    collective(*(t for t in (host_out, host_in) if t is not None), group=group, **kwargs)
    if host_out is not out:
        out.copy_(host_out.to(out.device))


def _staged(out: torch.Tensor, inp: torch.Tensor | None, group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensors a collective runs on: out and inp themselves, or host copies where the backend needs them."""
    if not needs_host_staging(out, group):
        return out, inp
    # With an input, `out` is only written: its values (possibly never materialized on the device) are not read.
    return (out.cpu() if inp is None else torch.empty(out.shape, dtype=out.dtype)), (None if inp is None else inp.cpu())


SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


def peer_lost(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another rank went away; that rank reports its own error,
    so this one only needs to say it stopped too."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def send(tensor: torch.Tensor, dst: int, tag: int):
    """Start sending `tensor` to global rank `dst`; returns (work, the tensor to keep alive until it is sent).
    Staged through host memory where the backend cannot address the tensor, as every collective here is."""
    if needs_host_staging(tensor):
        tensor = tensor.cpu()
    return dist.isend(tensor, dst, tag=tag), tensor


def recv(out: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    """Receive into `out` from global rank `src` (blocking); returns out."""
    buffer = out.cpu() if needs_host_staging(out) else out
    dist.irecv(buffer, src, tag=tag).wait()
    if buffer is not out:
        out.copy_(buffer.to(out.device))
    return out


def start_recv(out: torch.Tensor, src: int, tag: int) -> Callable[[], torch.Tensor]:
    """Post a receive into `out` from global rank `src`; returns wait(), which blocks until it is there and
    returns out. Staged through a host buffer where the backend needs it, copied to out's device only in wait().

    Posted now on gloo, which matches receives by (src, tag) in posting order, apart from any send, and moves the
    data once the receive is posted, in its own thread. Elsewhere it is posted in wait(), as recv does: NCCL runs a
    pair's sends and receives in posting order on one stream, so a receive posted ahead of a send to that peer
    would hold the send back, while the peer may need what it carries before it can send what the receive awaits."""
    if dist.get_backend() != "gloo":
        return lambda: recv(out, src, tag)
    buffer = torch.empty(out.shape, dtype=out.dtype) if needs_host_staging(out) else out
    work = dist.irecv(buffer, src, tag=tag)

    def wait() -> torch.Tensor:
        work.wait()
        if buffer is not out:
            out.copy_(buffer.to(out.device))
        return out
    return wait


def start_ring_pass(x: torch.Tensor, axis: AxisGroup, tag: int):
    """Start sending x to the next rank of `axis` (in axis order, wrapping round) and receiving the previous
    rank's tensor of the same shape; finish_ring_pass returns it. Both directions are one batch: NCCL runs the pair
    as one grouped operation (separate calls, each rank first waiting to receive, would wait round the ring
    forever); gloo runs them side by side. Staged through host memory where the backend needs it."""
    send = x.contiguous()
    if needs_host_staging(send, axis.group):
        send = send.cpu()
    received = torch.empty_like(send)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.irecv, received, axis.ranks[(axis.rank - 1) % axis.size], axis.group, tag),
        dist.P2POp(dist.isend, send, axis.ranks[(axis.rank + 1) % axis.size], axis.group, tag)])
    return works, send, received, x.device  # the send buffer stays referenced until the pass is finished


def finish_ring_pass(pending) -> torch.Tensor:
    works, _send, received, device = pending
    for work in works:
        work.wait()
    return received if received.device == device else received.to(device)


def all_reduce(x: torch.Tensor, axis: AxisGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; returns x."""
    if axis.size > 1:
        _on_host(dist.all_reduce, x, None, axis.group, op=op)
    return x


def all_reduce_world(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over every rank; returns x."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        _on_host(dist.all_reduce, x, None, None, op=op)
    return x


def broadcast(x: torch.Tensor, axis: AxisGroup, src_index: int = 0) -> torch.Tensor:
    """In place, from the group's member number `src_index` to the others; returns x."""
    if axis.size > 1:
        _on_host(dist.broadcast, x, None, axis.group, src=axis.ranks[src_index])
    return x


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, axis: AxisGroup) -> None:
    """out (size * n,) <- concatenation of every rank's shard (n,)."""
    assert out.numel() == shard.numel() * axis.size, (out.shape, shard.shape, axis.size)
    if axis.size == 1:
        out.copy_(shard)
    else:
        _on_host(_all_gather_single, out, shard.contiguous(), axis.group)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, axis: AxisGroup) -> None:
    """out (n,) <- sum over ranks of this rank's slice full[rank * n:(rank + 1) * n]."""
    assert full.numel() == out.numel() * axis.size, (full.shape, out.shape, axis.size)
    if axis.size == 1:
        out.copy_(full)
    else:
        _on_host(_reduce_scatter_single, out, full.contiguous(), axis.group)


class Pending:
    """A collective started with async_op: wait() finishes it (and copies a host-staged result back)."""

    __slots__ = ("work", "out", "host_out", "keep")

    def __init__(self, work, out: torch.Tensor, host_out: torch.Tensor | None, keep: tuple):
        self.work, self.out, self.host_out = work, out, host_out
        self.keep = keep  # inputs the backend may still be reading until the work is done

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.host_out is not None:
                self.out.copy_(self.host_out.to(self.out.device))
        self.keep = ()


def _start_on_host(collective, out: torch.Tensor, inp: torch.Tensor | None, group, **kwargs) -> Pending:
    """_on_host with async_op: the same call, returned unfinished."""
    host_out, host_in = _staged(out, inp, group)
    work = collective(*(t for t in (host_out, host_in) if t is not None), group=group, async_op=True, **kwargs)
    return Pending(work, out, None if host_out is out else host_out, (host_in,))


def start_all_reduce(x: torch.Tensor, axis: AxisGroup) -> Pending:
    """all_reduce (sum, in place), started: x holds the sum once the result is waited on."""
    if axis.size == 1:
        return Pending(None, x, None, ())
    return _start_on_host(dist.all_reduce, x, None, axis.group, op=SUM)


# Backends whose reduce-scatter / all-gather may take the rank's own slice of the other tensor (in place): NCCL
# documents it; gloo computes it bitwise as out of place (checked at world sizes 2 and 4). torch-xla's is not
# relied on, nor a host-staged call's.
_IN_PLACE_BACKENDS = ("gloo", "nccl")


def in_place_shard_ok(buffer: torch.Tensor, axis: AxisGroup) -> bool:
    """Whether ZeRO-1's reduce-scatter may write into, and its all-gather read from, the rank's own slice of
    `buffer` (saving a shard-sized copy per collective in flight)."""
    if axis.size == 1 or not dist.is_initialized():
        return True
    return dist.get_backend(axis.group) in _IN_PLACE_BACKENDS and not needs_host_staging(buffer, axis.group)


def reduce_scatter_copies_input(axis: AxisGroup) -> bool:
    """gloo's reduce-scatter holds a copy of its whole input while it runs (measured: 0.8 GB in flight took 0.8 GB
    more), so many at once cost a second copy of what they reduce."""
    return axis.size > 1 and dist.is_initialized() and dist.get_backend(axis.group) == "gloo"


def start_reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, axis: AxisGroup) -> Pending:
    """reduce_scatter_flat, started; `full` must not change until it is waited on."""
    assert full.numel() == out.numel() * axis.size, (full.shape, out.shape, axis.size)
    if axis.size == 1:
        out.copy_(full)
        return Pending(None, out, None, ())
    return _start_on_host(_reduce_scatter_single, out, full.contiguous(), axis.group)


def start_all_gather_flat(out: torch.Tensor, shard: torch.Tensor, axis: AxisGroup) -> Pending:
    """all_gather_flat, started; `shard` is kept alive until it is waited on."""
    assert out.numel() == shard.numel() * axis.size, (out.shape, shard.shape, axis.size)
    if axis.size == 1:
        out.copy_(shard)
        return Pending(None, out, None, ())
    return _start_on_host(_all_gather_single, out, shard.contiguous(), axis.group)


def all_to_all(x: torch.Tensor, axis: AxisGroup, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None) -> torch.Tensor:
    """Rank i sends rows in_splits[j] of x (in order) to rank j and receives out_splits[j] rows from rank j,
    concatenated in rank order. Equal splits when both are None."""
    if axis.size == 1:
        return x
    x = x.contiguous()
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _on_host(dist.all_to_all_single, out, x, axis.group, output_split_sizes=out_splits,
             input_split_sizes=in_splits)
    return out


class AllToAll(torch.autograd.Function):
    """Tokens to the ranks that own their experts and back: the adjoint of an all-to-all is the all-to-all with
    the splits swapped."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.out_splits, ctx.in_splits = axis, out_splits, in_splits
        return all_to_all(x, axis, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.axis, ctx.in_splits, ctx.out_splits), None, None, None


def exchange(x: torch.Tensor, axis: AxisGroup, out_splits: list[int] | None, in_splits: list[int] | None
             ) -> torch.Tensor:
    """all_to_all with its backward (None splits: equal)."""
    return AllToAll.apply(x, axis, out_splits, in_splits) if axis.size > 1 else x


def gather_along(x: torch.Tensor, dim: int, axis: AxisGroup) -> torch.Tensor:
    """Concatenate every rank's x along `dim`."""
    if axis.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((axis.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _on_host(_all_gather_single, out, x, axis.group)          # concatenated along dim 0
    out = out.view(axis.size, *x.shape)                        # (t, *x.shape)
    if dim % x.dim() == 0:
        return out.flatten(0, 1)
    return torch.cat(out.unbind(0), dim=dim)                    # one copy to put the shards side by side


def reduce_scatter_along(x: torch.Tensor, dim: int, axis: AxisGroup) -> torch.Tensor:
    """Sum x over ranks and keep this rank's chunk along `dim`."""
    if axis.size == 1:
        return x
    assert x.shape[dim] % axis.size == 0, f"dim {dim} of {tuple(x.shape)} is not divisible by {axis.size}"
    # Bring the chunks into rank order in memory: (t, *chunk_shape).
    stacked = torch.stack(x.chunk(axis.size, dim=dim)) if dim % x.dim() else x.contiguous()
    chunk_shape = list(x.shape)
    chunk_shape[dim] //= axis.size
    out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
    _on_host(_reduce_scatter_single, out, stacked.view(-1, *chunk_shape[1:]), axis.group)  # (t * c0, ...)
    return out


def split_along(x: torch.Tensor, dim: int, axis: AxisGroup) -> torch.Tensor:
    """This rank's chunk of x along `dim` (no communication)."""
    if axis.size == 1:
        return x
    assert x.shape[dim] % axis.size == 0, f"dim {dim} of {tuple(x.shape)} is not divisible by {axis.size}"
    return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()


class CopyToRegion(torch.autograd.Function):
    """Enter a tensor-parallel region with a replicated X: forward Y = X; backward dX = sum_i dY_i (all-reduce).

    Each rank's partial dY_i covers only its slice of the weights that consume X, so the true gradient is the sum.
    """

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.axis), None


class ReduceFromRegion(torch.autograd.Function):
    """Leave a tensor-parallel region: forward Y = sum_i X_i (all-reduce); backward dX_i = dY (identity)."""

    @staticmethod
    def forward(ctx, x, axis):
        # In place on the partial sums (nothing else holds them), declared to autograd with mark_dirty.
        ctx.mark_dirty(x)
        return all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToSequence(torch.autograd.Function):
    """Replicated X -> sequence shard: forward Y_i = X[:, shard i]; backward dX = concat_i dY_i (all-gather)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return split_along(x, SEQUENCE_DIM, axis)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, SEQUENCE_DIM, ctx.axis), None


class GatherFromSequence(torch.autograd.Function):
    """Sequence shards -> full sequence entering a TP region: forward Y = concat_i X_i (all-gather);
    backward dX_i = (sum_j dY_j)[:, shard i] (reduce-scatter), since each rank's dY_j is a partial gradient
    from its slice of the weights that consume Y (the sequence-parallel counterpart of CopyToRegion)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return gather_along(x, SEQUENCE_DIM, axis)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, SEQUENCE_DIM, ctx.axis), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Partial sums -> sequence shard leaving a TP region: forward Y_i = (sum_j X_j)[:, shard i]
    (reduce-scatter); backward dX_j = concat_i dY_i (all-gather). The sequence-parallel ReduceFromRegion."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return reduce_scatter_along(x, SEQUENCE_DIM, axis)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, SEQUENCE_DIM, ctx.axis), None


class GatherFromRegion(torch.autograd.Function):
    """Shards -> the whole tensor along `dim`, for a computation every rank then repeats in full (the vocabulary's
    column shards on the last dim; an MoE block gathering the sequence to route the whole micro-batch): forward
    Y = concat_i X_i (all-gather); backward dX_i = dY[shard i] (split), since every rank holds the same full dY
    (not a partial sum, unlike GatherFromSequence)."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return gather_along(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.dim, ctx.axis), None, None


def gather_sequence_replicated(x, axis):
    return GatherFromRegion.apply(x, axis, SEQUENCE_DIM) if axis.size > 1 else x


def copy_to_region(x, axis):
    return CopyToRegion.apply(x, axis) if axis.size > 1 else x


def reduce_from_region(x, axis):
    return ReduceFromRegion.apply(x, axis) if axis.size > 1 else x


def scatter_to_sequence(x, axis):
    return ScatterToSequence.apply(x, axis) if axis.size > 1 else x


def gather_from_sequence(x, axis):
    return GatherFromSequence.apply(x, axis) if axis.size > 1 else x


def reduce_scatter_to_sequence(x, axis):
    return ReduceScatterToSequence.apply(x, axis) if axis.size > 1 else x


def gather_from_region(x, axis):
    return GatherFromRegion.apply(x, axis, -1) if axis.size > 1 else x
