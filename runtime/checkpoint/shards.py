# What one rank contributes to a checkpoint, in coordinates of the unsharded model, and the reverse: filling a
# rank's parameters and optimizer shards, under any layout, from every saved rank's contributions.
#
# A piece is part of one full parameter (by its single-process name, e.g. `layers.3.attn.qkv.weight`):
#   dim, index     the rows of the full tensor along `dim` that the saving rank's TP shard held (None: all)
#   shard_shape    that TP shard's shape
#   start          where the piece begins in the shard, flattened (ZeRO-1 cuts a shard at any element)
#   experts        for an expert-parallel shard, the experts (rows along dim 0 of the full tensor) it holds
# and its values: `value` for weights (whole shards; under ZeRO-3 each DP rank's range of them), `master` and the optimizer's state keys
# (exp_avg/exp_avg_sq, momentum_buffer, z: runtime/parallel/optimizers.py) for optimizer state.
# Pieces are written once per distinct value: weights by the first DP replica (the first expert-data-parallel
# replica for experts), TP-replicated tensors by TP rank 0, optimizer state by every DP rank under ZeRO-1 (each
# holds different elements; hybrid sharding: every rank of the first replica group) and by the first otherwise.
#
# Loading fills each bucket from a source: reshard.RangedSource reads from the rank files only the byte ranges
# this rank now holds (that is the reshard: nothing in the format depends on the saving layout); FullTensors
# reassembles whole tensors from pieces already in memory (checkpoints of format 1, conversion).
# torch.distributed.checkpoint reshards too, but only rectangular chunks of DTensors; a fused QKV row set or a
# replicated KV head is not one, and a ZeRO-1 shard is a range of a flattened bucket, so the format is our own.
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
from torch import nn

from runtime.checkpoint.reshard import TIED, Target
from runtime.device import fetch_to_host
from runtime.parallel.data_parallel import DataParallel
from runtime.parallel.optimizers import STATE_KEYS
from runtime.parallel.plan import ShardingPlan

__all__ = ["TIED", "FullTensors", "HostStaging", "host_copy", "load_into", "rank_pieces"]


def _geometry(plan: ShardingPlan, name: str, param: nn.Parameter) -> dict:
    placement = plan[name]
    index = placement.index.cpu() if placement.sharded else None
    geometry = {"dim": placement.dim, "index": index, "full_shape": plan.full_shape(name, param),
                "shard_shape": tuple(param.shape)}
    if placement.expert:
        geometry["experts"] = placement.experts.cpu()
    return geometry


def rank_pieces(dp: DataParallel, optimizer, topo, origins: dict | None = None) -> tuple[dict, dict]:
    """This rank's pieces as views of live tensors (copy them before training goes on): (model, optim), each
    {full name: [piece, ...]}. `optimizer` is the ShardedAdamW over `dp`. origins, when given, gets each piece
    tensor's place in the flat buffer it is a range of, {id(tensor): (buffer, first element)}: what a device that
    transfers only whole tensors fetches (staging.StreamedSnapshot)."""
    plan = dp.plan
    names = {id(p): name for name, p in dp.named_params}
    model_pieces: dict[str, list] = {}
    optim_pieces: dict[str, list] = {}
    first_tp = topo.tp.rank == 0
    in_buffer = {}  # id(param) -> (its bucket's flat buffer, first element)
    for bucket in dp.buckets:
        offset = 0
        for param in bucket.params:
            in_buffer[id(param)] = (bucket.param_buffer, offset)
            offset += param.numel()

    def ranged(tensor: torch.Tensor, base: torch.Tensor, first: int) -> torch.Tensor:
        if origins is not None:
            origins[id(tensor)] = (base, first)
        return tensor

    zero3 = [b for b in dp.buckets if b.param_shard is not None]  # no rank holds these weights whole
    in_zero3 = {id(p) for b in zero3 for p in b.params}
    for name, param in dp.named_params:
        first_replica = (topo.edp if plan[name].expert else topo.dp).rank == 0
        if first_replica and (first_tp or plan[name].sharded) and id(param) not in in_zero3:
            model_pieces.setdefault(plan.full_name(name), []).append(
                {**_geometry(plan, name, param), "start": 0, "value": ranged(param.detach(), *in_buffer[id(param)])})
    for bucket in zero3:  # each DP rank's range, as its optimizer state below (hybrid: the first replica's)
        if bucket.replica_axis.rank != 0:
            continue
        for seg in bucket.segments:
            name = names[id(seg.param)]
            if plan[name].sharded or first_tp:
                model_pieces.setdefault(plan.full_name(name), []).append(
                    {**_geometry(plan, name, seg.param), "start": seg.in_param.start,
                     "value": ranged(bucket.param_shard[seg.in_shard], bucket.param_shard, seg.in_shard.start)})
    for bucket, state in zip(dp.buckets, optimizer.state):
        if not (bucket.axis.rank == 0 or dp.zero1) or bucket.replica_axis.rank != 0:
            continue
        for seg in bucket.segments:
            name = names[id(seg.param)]
            if not plan[name].sharded and not first_tp:
                continue
            first = seg.in_shard.start
            piece = {**_geometry(plan, name, seg.param), "start": seg.in_param.start,
                     **{key: ranged(flat[seg.in_shard], flat, first) for key, flat in state.items()},
                     "master": (ranged(bucket.master[seg.in_shard], bucket.master, first)
                                if bucket.master is not None else None)}
            optim_pieces.setdefault(plan.full_name(name), []).append(piece)
    return model_pieces, optim_pieces


def host_copy(tree):
    """A copy of every tensor in a nested dict/list on the host (device tensors are moved, host ones cloned)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: host_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(host_copy(v) for v in tree)
    return tree


def _replace(tree, values):
    """`tree` with its tensors replaced, in _tensors' order, by the next of `values`."""
    if isinstance(tree, torch.Tensor):
        return next(values)
    if isinstance(tree, dict):
        return {k: _replace(v, values) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replace(v, values) for v in tree)
    return tree


class HostStaging:
    """Reusable host buffers for checkpoint copies: one flat buffer per dtype, kept between saves.

    Copying into memory that is already mapped runs at memory bandwidth; a fresh allocation of the same size
    pays a page fault per page on first touch, several times slower, and the copy is what training waits for.
    The buffers stay allocated for the run (their size is what rank 0 reports with each commit); a save
    whose tensors differ in number or shape from the last one gets new buffers.
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._signature: list | None = None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    @staticmethod
    def _tensors(tree, out: list) -> list:
        if isinstance(tree, torch.Tensor):
            out.append(tree)
        elif isinstance(tree, dict):
            for v in tree.values():
                HostStaging._tensors(v, out)
        elif isinstance(tree, (list, tuple)):
            for v in tree:
                HostStaging._tensors(v, out)
        return out

    def copy(self, tree):
        """A copy of `tree` whose float tensors are views of the staging buffers (others are cloned); on XLA, the
        host copies of one transfer (device.fetch_to_host), which need no staging buffer."""
        fetched = fetch_to_host(self._tensors(tree, []))
        if fetched is not None:
            return _replace(tree, iter(fetched))
        tensors = [t for t in self._tensors(tree, []) if t.is_floating_point()]
        signature = [(t.dtype, tuple(t.shape)) for t in tensors]
        if signature != self._signature:
            sizes: dict[torch.dtype, int] = {}
            for t in tensors:
                sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
            self._buffers = {dtype: torch.empty(n, dtype=dtype, pin_memory=self.pin) for dtype, n in sizes.items()}
            self._signature = signature
        offsets = {dtype: 0 for dtype in self._buffers}

        def walk(node):
            if isinstance(node, torch.Tensor):
                if not node.is_floating_point():
                    return node.detach().to("cpu", copy=True)
                start = offsets[node.dtype]
                offsets[node.dtype] = start + node.numel()
                view = self._buffers[node.dtype][start:start + node.numel()].view(node.shape)
                view.copy_(node.detach())
                return view
            if isinstance(node, dict):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return type(node)(walk(v) for v in node)
            return node

        return walk(tree)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class FullTensors:
    """Reassembles full tensors from every saved rank's pieces: `get(name, key)` with key value | master | an
    optimizer's state key (exp_avg, momentum_buffer, z...), or None when the checkpoint has no such state."""

    def __init__(self, model_pieces: Iterable[tuple[str, dict]], optim_pieces: Iterable[tuple[str, dict]]):
        self._pieces: dict[tuple[str, str], list[dict]] = {}
        for name, piece in model_pieces:
            self._pieces.setdefault((name, "value"), []).append(piece)
        for name, piece in optim_pieces:
            for key in (*STATE_KEYS, "master"):
                if piece.get(key) is not None:
                    self._pieces.setdefault((name, key), []).append(piece)

    def names(self) -> set[str]:
        return {name for name, _ in self._pieces}

    def _resolve(self, name: str, key: str) -> str:
        if (name, key) not in self._pieces and name in TIED:
            other = TIED[1 - TIED.index(name)]
            if (other, key) in self._pieces:
                return other
        return name

    def has(self, name: str, key: str) -> bool:
        return (self._resolve(name, key), key) in self._pieces

    def full_shape(self, name: str, key: str = "value") -> tuple | None:
        pieces = self._pieces.get((self._resolve(name, key), key))
        return tuple(pieces[0]["full_shape"]) if pieces else None

    def dtype(self, name: str, key: str = "value") -> torch.dtype | None:
        pieces = self._pieces.get((self._resolve(name, key), key))
        return pieces[0][key].dtype if pieces else None

    def read(self, name: str, key: str, rows: dict) -> torch.Tensor:
        """As RangedSource.read: the full tensor at `rows`, cut from the whole one."""
        return Target((), rows).take(self.get(name, key))

    def fill(self, name: str, target: Target, lo: int, hi: int, outs: dict) -> None:
        """As RangedSource.fill, from the whole tensor (cut for each target: fine for the small checkpoints of
        format 1 and for imports; new checkpoints load by range)."""
        for out, key in outs.values():
            out.copy_(target.take(self.get(name, key)).reshape(-1)[lo:hi])

    def run(self) -> None:
        pass

    def get(self, name: str, key: str) -> torch.Tensor | None:
        pieces = self._pieces.get((self._resolve(name, key), key))
        if not pieces:
            return None
        first = pieces[0]
        full = torch.empty(first["full_shape"], dtype=first[key].dtype)
        covered = torch.zeros(first["full_shape"], dtype=torch.bool)
        # Pieces of one TP shard (from different ZeRO-1 ranks) are stitched in the shard's flat order first.
        shards: dict[tuple, tuple[dict, torch.Tensor, torch.Tensor]] = {}
        for piece in pieces:
            index, experts = piece["index"], piece.get("experts")
            shard_id = (piece["dim"], None if index is None else tuple(index.tolist()), tuple(piece["shard_shape"]),
                        None if experts is None else tuple(experts.tolist()))
            if shard_id not in shards:
                numel = int(torch.Size(piece["shard_shape"]).numel())
                shards[shard_id] = (piece, torch.empty(numel, dtype=full.dtype), torch.zeros(numel, dtype=torch.bool))
            _, flat, seen = shards[shard_id]
            data = piece[key].reshape(-1)
            flat[piece["start"]:piece["start"] + data.numel()] = data
            seen[piece["start"]:piece["start"] + data.numel()] = True
        for piece, flat, seen in shards.values():
            _place(full, piece, flat.view(piece["shard_shape"]))
            _place(covered, piece, seen.view(piece["shard_shape"]), accumulate=True)
        if not bool(covered.all()):
            raise ValueError(f"checkpoint is incomplete: {key} of {name} is missing "
                             f"{int((~covered).sum())} of {covered.numel()} elements")
        return full


def _place(full: torch.Tensor, piece: dict, shard: torch.Tensor, accumulate: bool = False) -> None:
    """Write a saved shard into the full tensor at its experts (dim 0) and TP rows (piece's dim); accumulate:
    OR it into what is there (coverage masks)."""
    experts = piece.get("experts")
    target = full if experts is None else full.index_select(0, experts)
    if piece["dim"] is None:
        target.copy_(shard | target if accumulate else shard)
    else:
        rows = piece["index"]
        target.index_copy_(piece["dim"], rows, shard | target.index_select(piece["dim"], rows) if accumulate
                           else shard)
    if experts is not None:
        full.index_copy_(0, experts, target)


@torch.no_grad()
def load_into(dp: DataParallel, optimizer, source, *, broadcast: Callable | None = None,
              with_optimizer: bool = True) -> None:
    """Fill this rank's parameters, master weights and (with_optimizer) optimizer state from `source` (a
    RangedSource or FullTensors; None on ranks that only receive). `optimizer` may be None when with_optimizer
    is False.

    broadcast(tensor, axis) is called on every filled tensor of a bucket in the same order on every rank of the
    bucket's replica group `axis` (dp, or edp for experts): its rank 0 (a reader) sends, the others receive.
    Without it every rank reads for itself: the whole bucket's weights and only its own shard of the optimizer
    state, straight into the live buffers when they are on the host.
    """
    # ZeRO-3: the full buffers exist while they are read into; each rank keeps its shard of them after.
    with dp.zero3.full_parameters(load=True) if dp.zero3 is not None else contextlib.nullcontext():
        _load_into(dp, optimizer, source, broadcast, with_optimizer)


def _load_into(dp: DataParallel, optimizer, source, broadcast: Callable | None, with_optimizer: bool) -> None:
    plan = dp.plan
    names = {id(p): name for name, p in dp.named_params}
    states = optimizer.state if optimizer is not None else [{} for _ in dp.buckets]
    for bucket, optim_state in zip(dp.buckets, states):
        device = bucket.param_buffer.device
        padded = bucket.param_buffer.numel()
        # Only the states this optimizer holds are read (and broadcast): no moments when they are not wanted,
        # no master copy for fp32 weights. With a broadcast, the whole bucket's state, as a DP rank without
        # ZeRO-1 would hold it (each receiver keeps its own shard); without, this rank's shard.
        optim_keys = list(optim_state) if with_optimizer else []
        keys = optim_keys + (["master"] if bucket.master is not None else [])
        span = slice(0, padded) if broadcast is not None else bucket.shard
        live = {**optim_state, "master": bucket.master}
        in_place = broadcast is None and bucket.param_buffer.is_cpu  # host memory: read into it directly
        if in_place:  # zeroed below only where the checkpoint has nothing for them
            values, state = bucket.param_buffer, {key: live[key] for key in keys}
        else:
            values = torch.zeros(padded, dtype=bucket.param_buffer.dtype)
            state = {key: torch.zeros(span.stop - span.start, dtype=torch.float32) for key in keys}
        have = torch.zeros(len(keys), dtype=torch.float32)  # which of them the checkpoint has
        if source is not None:
            _read_bucket(source, plan, names, bucket, keys, span, values, state, have, with_optimizer)
        if broadcast is not None:
            for tensor in (values, have, *state.values()):
                broadcast(tensor, bucket.axis)
        mine = slice(bucket.shard.start - span.start, bucket.shard.stop - span.start)
        if not in_place:
            bucket.param_buffer.copy_(values.to(device))
            if bucket.master is not None:
                bucket.master.copy_(state["master"][mine].to(device))
        if optim_state:
            if with_optimizer and optim_keys and bool(have[:len(optim_keys)].all()):
                if not in_place:
                    for key in optim_keys:
                        optim_state[key].copy_(state[key][mine].to(device))
            else:
                for tensor in optim_state.values():
                    tensor.zero_()


def _read_bucket(source, plan: ShardingPlan, names: dict, bucket, keys: list[str], span: slice,
                 values: torch.Tensor, state: dict, have: torch.Tensor, with_optimizer: bool) -> None:
    """load_into's reads for one bucket: every parameter's weights into `values` (the bucket's padded flat
    buffer) and its `keys` over the elements of `span` into `state`, checked against this model first; `have`
    marks the keys the checkpoint has. What the checkpoint has nothing for, and the ZeRO-1 padding, are zeroed."""
    offset = 0
    for param in bucket.params:
        local, n = names[id(param)], param.numel()
        name = plan.full_name(local)
        if not source.has(name, "value"):
            raise ValueError(f"checkpoint has no weights for {name}: it was saved from a different model")
        saved, expected = source.full_shape(name, "value"), plan.full_shape(local, param)
        if tuple(saved) != tuple(expected):
            raise ValueError(f"checkpoint holds {name} with shape {tuple(saved)} but this model's is "
                             f"{tuple(expected)}: the checkpoint was saved from a different model config")
        target = Target.of(plan, local, param)
        weights = {"value": (values[offset:offset + n], "value")}
        lo, hi = max(offset, span.start), min(offset + n, span.stop)
        outs = {}
        for i, key in enumerate(keys if lo < hi else ()):
            dest = state[key][lo - span.start:hi - span.start]
            if with_optimizer and source.has(name, key):
                outs[key] = (dest, key)
                have[i] = 1
            elif key == "master":  # fp32 weights serve as the master copy of a bf16 run
                outs[key] = (dest, "value")
            else:
                dest.zero_()
        if (lo, hi) == (offset, offset + n):  # one plan for the weights and the whole state
            source.fill(name, target, 0, n, {**weights, **outs})
        else:
            source.fill(name, target, 0, n, weights)
            if outs:
                source.fill(name, target, lo - offset, hi - offset, outs)
        offset += n
    values[offset:].zero_()  # ZeRO-1 padding
    for tensor in state.values():
        tensor[max(0, offset - span.start):].zero_()
    source.run()
