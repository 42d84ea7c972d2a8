# Index arithmetic on selections of a full tensor, for reshard.py. A selection is, per dim, a position: a slice
# (a run of indices; selecting it is a view) or a LongTensor of indices (selecting it is a gather). Pure functions
# of tensors and shapes, no I/O.
from __future__ import annotations

import itertools
import math

import torch

MAX_BLOCKS = 256  # contiguous_blocks gives up (returns None) beyond this many contiguous blocks


def run_slice(index: torch.Tensor):
    """A slice for an index that is one increasing run (a view instead of a gather), else the index."""
    n = index.numel()
    if n and int(index[-1]) - int(index[0]) == n - 1 and (n == 1 or bool((index.diff() == 1).all())):
        return slice(int(index[0]), int(index[0]) + n)
    return index


def length(position) -> int:
    return position.stop - position.start if isinstance(position, slice) else position.numel()


def as_index(position) -> torch.Tensor:
    return torch.arange(position.start, position.stop) if isinstance(position, slice) else position


def select(tensor: torch.Tensor, positions: list) -> torch.Tensor:
    for dim, position in enumerate(positions):
        if isinstance(position, slice):
            tensor = tensor.narrow(dim, position.start, position.stop - position.start)
        else:
            tensor = tensor.index_select(dim, position)
    return tensor


def scatter(window: torch.Tensor, positions: list, values: torch.Tensor) -> None:
    """window[ix_(positions)] = values."""
    view = window
    gathers = [dim for dim, p in enumerate(positions) if not isinstance(p, slice)]
    for dim, position in enumerate(positions):
        if isinstance(position, slice):
            view = view.narrow(dim, position.start, position.stop - position.start)
    values = values.to(window.dtype)
    if not gathers:
        view.copy_(values)
    elif len(gathers) == 1:
        view.index_copy_(gathers[0], positions[gathers[0]], values)
    else:
        index = [torch.arange(view.shape[d]) if d not in gathers else positions[d] for d in range(view.dim())]
        index = [ix.view([-1 if d == k else 1 for d in range(view.dim())]) for k, ix in enumerate(index)]
        view.index_put_(tuple(index), values)


def restrict(saved, wanted, first: int, stop: int):
    """Of dim-0 positions (saved in the shard, wanted in the window), those of shard rows [first, stop), the saved
    ones counted from `first`; None if there are none."""
    if isinstance(saved, slice):
        lo, hi = max(saved.start, first), min(saved.stop, stop)
        if lo >= hi:
            return None
        if isinstance(wanted, slice):
            at = wanted.start - saved.start
            return slice(lo - first, hi - first), slice(lo + at, hi + at)
        return slice(lo - first, hi - first), run_slice(wanted[lo - saved.start:hi - saved.start])
    keep = (saved >= first) & (saved < stop)
    if not bool(keep.any()):
        return None
    return run_slice(saved[keep] - first), run_slice(as_index(wanted)[keep])


def row_major_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def contiguous_blocks(saved: list, wanted: list, saved_shape, window_shape) -> list[tuple[int, int, int]] | None:
    """The intersection as (flat start in the shard, flat start in the window, length) blocks contiguous in
    both, merged where adjacent; None when there would be more than MAX_BLOCKS."""
    whole = [isinstance(p, slice) and isinstance(t, slice) and p == slice(0, s) and t == slice(0, w)
             for p, t, s, w in zip(saved, wanted, saved_shape, window_shape)]
    last = max((d for d, w in enumerate(whole) if not w), default=-1)
    inner = math.prod(saved_shape[last + 1:])
    if last < 0:
        return [(0, 0, inner)]
    p_index, t_index = as_index(saved[last]), as_index(wanted[last])
    ends = ((p_index.diff() != 1) | (t_index.diff() != 1)).nonzero()[:, 0].add(1).tolist()
    if math.prod(length(saved[d]) for d in range(last)) * (len(ends) + 1) > MAX_BLOCKS:
        return None
    runs = [(int(p_index[a]), int(t_index[a]), b - a) for a, b in zip([0] + ends, ends + [p_index.numel()])]
    outer = [list(zip(as_index(saved[d]).tolist(), as_index(wanted[d]).tolist())) for d in range(last)]
    saved_strides, window_strides = row_major_strides(saved_shape), row_major_strides(window_shape)
    blocks: list[list[int]] = []
    for combo in itertools.product(*outer):
        base_p = sum(p * saved_strides[d] for d, (p, _) in enumerate(combo))
        base_t = sum(t * window_strides[d] for d, (_, t) in enumerate(combo))
        for p, t, n in runs:
            start_p, start_t = base_p + p * saved_strides[last], base_t + t * window_strides[last]
            if blocks and blocks[-1][0] + blocks[-1][2] == start_p and blocks[-1][1] + blocks[-1][2] == start_t:
                blocks[-1][2] += n * inner
            else:
                blocks.append([start_p, start_t, n * inner])
    return [tuple(b) for b in blocks]
