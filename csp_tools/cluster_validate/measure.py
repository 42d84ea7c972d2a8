# The timed collective loop, run by every rank of a group inside an initialized torch.distributed process group.
#
# What is timed is nothing but the operation itself: buffers are allocated and the call is bound before the
# clock starts, the loop body is one call (plus the XLA step marker that lazy devices need), and the device is
# synchronized once at the end, as nccl-tests does. The per-rank mean time is then averaged over the ranks
# (nccl-tests' default) outside the timed region. Correctness is checked in a separate pass on known inputs, so
# the check costs the timing nothing.
#
# Backends: gloo (CPU), nccl (CUDA), xla (torch-xla). Each operation uses the tensor form first
# (all_gather_single / reduce_scatter_single / all_to_all_single, or their pre-2.13 names); a backend that
# rejects it (older gloo has no reduce_scatter_tensor) falls back to the list form of the same operation on
# views of the same buffers, which moves the same bytes; the row records which form ran. An operation neither
# form supports is reported as an error row, never emulated with another operation.
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from csp_tools.cluster_validate.bandwidth import DTYPES, Row, aligned_size, error_row, make_row

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_UNSUPPORTED = ("not supported", "does not support", "unsupported", "not implemented")


@dataclass(frozen=True)
class DeviceHooks:
    """What the loop needs from the device: where tensors live, and how to wait for / flush queued work."""

    device: torch.device
    synchronize: Callable[[], None] = lambda: None
    step: Callable[[], None] | None = None  # XLA: cut the lazy graph after each operation


def cpu_hooks() -> DeviceHooks:
    return DeviceHooks(torch.device("cpu"))


def _pattern(rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Small integers: exact in float32, and sums over many ranks stay well inside its 24-bit mantissa.
    idx = torch.arange(count, device=device)
    return ((rank + 1) * 3 + idx % 5).to(dtype)


def _buffers(op: str, count: int, ranks: int, dtype: torch.dtype, device: torch.device):
    """(input, output) for one operation; count is the element count of the operation's size."""
    if op in ("all_reduce", "broadcast"):
        buf = torch.empty(count, dtype=dtype, device=device)
        return buf, buf
    if op == "all_gather":
        return torch.empty(count // ranks, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device)
    if op == "reduce_scatter":
        return torch.empty(count, dtype=dtype, device=device), torch.empty(count // ranks, dtype=dtype, device=device)
    if op == "all_to_all":
        return torch.empty(count, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device)
    raise ValueError(op)


def _calls(op: str, inp: torch.Tensor, out: torch.Tensor, ranks: int) -> list[tuple[str, Callable[[], object]]]:
    """The ways to run `op` on these buffers, preferred first: (form, zero-argument call)."""
    if op == "all_reduce":
        return [("tensor", lambda: dist.all_reduce(inp))]
    if op == "broadcast":
        return [("tensor", lambda: dist.broadcast(inp, 0))]
    if op == "all_gather":
        views = list(out.chunk(ranks))
        return [("tensor", lambda: _all_gather_single(out, inp)), ("list", lambda: dist.all_gather(views, inp))]
    if op == "reduce_scatter":
        chunks = list(inp.chunk(ranks))
        return [("tensor", lambda: _reduce_scatter_single(out, inp)),
                ("list", lambda: dist.reduce_scatter(out, chunks))]
    if op == "all_to_all":
        outs, ins = list(out.chunk(ranks)), list(inp.chunk(ranks))
        return [("tensor", lambda: dist.all_to_all_single(out, inp)), ("list", lambda: dist.all_to_all(outs, ins))]
    raise ValueError(op)


def _expected(op: str, rank: int, ranks: int, count: int, dtype, device) -> torch.Tensor:
    per_rank = [_pattern(r, count // ranks if op == "all_gather" else count, dtype, device) for r in range(ranks)]
    if op == "all_reduce":
        return torch.stack(per_rank).sum(0)
    if op == "broadcast":
        return per_rank[0]
    if op == "all_gather":
        return torch.cat(per_rank)
    chunk = count // ranks
    if op == "reduce_scatter":
        return torch.stack(per_rank).sum(0)[rank * chunk:(rank + 1) * chunk]
    if op == "all_to_all":  # rank j receives chunk j of every rank r, in rank order
        return torch.cat([p[rank * chunk:(rank + 1) * chunk] for p in per_rank])
    raise ValueError(op)


def _mean_over_ranks(value: float, hooks: DeviceHooks) -> float:
    t = torch.tensor([value], dtype=torch.float64 if hooks.device.type != "xla" else torch.float32,
                     device=hooks.device)
    dist.all_reduce(t)
    if hooks.step:
        hooks.step()
    return float(t.item()) / dist.get_world_size()


def _sum_over_ranks(value: int, hooks: DeviceHooks) -> int:
    t = torch.tensor([value], dtype=torch.int64 if hooks.device.type != "xla" else torch.int32, device=hooks.device)
    dist.all_reduce(t)
    if hooks.step:
        hooks.step()
    return int(t.item())


def time_loop(call: Callable[[], object], iters: int, hooks: DeviceHooks) -> float:
    """Seconds per call on this rank: the clock brackets only the calls and one final synchronization."""
    step = hooks.step
    start = time.perf_counter()
    if step is None:
        for _ in range(iters):
            call()
    else:
        for _ in range(iters):
            call()
            step()
    hooks.synchronize()
    return (time.perf_counter() - start) / iters


def _is_unsupported(error: Exception) -> bool:
    return any(text in str(error).lower() for text in _UNSUPPORTED)


def measure_operation(op: str, size: int, *, dtype: str = "float32", warmup: int = 5, iters: int = 20,
                      check: bool = True, hooks: DeviceHooks | None = None) -> Row:
    """One row: `op` at `size` bytes over the default process group, timed on every rank.

    Every rank must call this with the same arguments (it is a collective). Raises on a backend error other
    than "unsupported" (a timeout, a lost peer): the group is then broken, and the caller stops using it."""
    hooks = hooks or cpu_hooks()
    ranks, rank = dist.get_world_size(), dist.get_rank()
    torch_dtype = getattr(torch, dtype)
    size = aligned_size(op, size, ranks, DTYPES[dtype][1])
    count = size // DTYPES[dtype][1]
    inp, out = _buffers(op, count, ranks, torch_dtype, hooks.device)
    inp.fill_(1)
    form, call = None, None
    for candidate_form, candidate in _calls(op, inp, out, ranks):
        try:
            candidate()
            hooks.synchronize()
        except RuntimeError as error:
            if not _is_unsupported(error):
                raise
            continue
        form, call = candidate_form, candidate
        break
    if call is None:
        return error_row(op, size, dtype, ranks, f"{op} is not supported by the {dist.get_backend()} backend")

    for _ in range(warmup):
        call()
        if hooks.step:
            hooks.step()
    hooks.synchronize()
    _sum_over_ranks(0, hooks)  # every rank leaves the warm-up before any starts its clock
    seconds = _mean_over_ranks(time_loop(call, iters, hooks), hooks)

    wrong = None
    if check:
        inp.copy_(_pattern(rank, inp.numel(), torch_dtype, hooks.device))
        if op != "all_reduce" and op != "broadcast":
            out.zero_()
        call()
        if hooks.step:
            hooks.step()
        hooks.synchronize()
        expected = _expected(op, rank, ranks, count, torch_dtype, hooks.device)
        tolerance = 0 if dtype == "float32" else 1e-2
        mismatched = int((~torch.isclose(out.float(), expected.float(), rtol=tolerance, atol=0)).sum())
        wrong = _sum_over_ranks(mismatched, hooks)
    row = make_row(op, size, dtype, seconds, ranks, wrong)
    return row if form == "tensor" else Row(**{**row.to_json(), "source": f"torch.distributed ({form} form)"})


def measure_sweep(operations, sizes, *, dtype="float32", warmup=5, iters=20, check=True,
                  hooks: DeviceHooks | None = None) -> list[Row]:
    """Every operation at every size, in that order (the same on every rank). Stops at the first backend error:
    the rows so far, then one error row for the operation and size that failed."""
    rows = []
    for op in operations:
        for size in sizes:
            try:
                rows.append(measure_operation(op, size, dtype=dtype, warmup=warmup, iters=iters, check=check,
                                              hooks=hooks))
            except Exception as error:  # noqa: BLE001 - reported in the row; the group is abandoned
                message = " ".join(str(error).split())[:300] or type(error).__name__
                rows.append(error_row(op, size, dtype, dist.get_world_size(), message))
                return rows
    return rows
