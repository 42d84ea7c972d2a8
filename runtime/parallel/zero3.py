# ZeRO-3 (model.zero_stage: 3, FSDP's full sharding): ZeRO-2 (runtime/parallel/data_parallel.py) with the
# parameters sharded too. Each bucket keeps only this rank's shard of its parameters (`param_shard`, the one the
# optimizer writes back into); its full `param_buffer` keeps its shape and the parameters stay views of it, but its
# storage is resized to nothing between uses and refilled by an all-gather when a unit needs it.
#
# A unit is a transformer block (a child of a `layers` list: every block of a pipeline stage's chunks), or the
# outermost module outside the blocks around other parameters (the embeddings, the final norm, the output head). Buckets never
# straddle units (data_parallel splits them at unit boundaries), so a unit gathers exactly its own buckets:
#   forward   pre-hook: gather (or wait for the prefetch), start the next unit's gather; post-hook: free.
#   backward  a hook on the unit's outputs (their gradient arrives before any of its backward runs, and before an
#             activation-checkpointed block recomputes): gather again, prefetch the unit before it; free once every
#             trainable parameter of the unit has had its gradient this backward (the hook data parallelism already
#             uses: the last use of a weight comes before its gradient is accumulated).
# A bucket is counted, not flagged, since a tied embedding's bucket is used by two units and a pipeline runs several
# micro-batches' forwards and backwards interleaved (1F1B, interleaved): correctness first, so a block may be gathered
# more than once per step. A unit whose backward did not reach every parameter (an expert no token chose) keeps its
# buckets until the end of backward (release_all, from reduce_gradients).
#
# Why our own and not torch's FSDP2 (fully_shard): FSDP2 shards each parameter as a DTensor over a DeviceMesh, on
# dim 0. Our tensor parallelism is plain tensors with a ShardingPlan (fused QKV rows, replicated KV heads, experts
# over EP), our optimizer and checkpoints work on flat bucket shards cut at any element (runtime/checkpoint/
# shards.py), and ZeRO-1/2 already own the reduce-scatter, the fp32 master shard, the global norm and the bf16
# rounding. Under FSDP2 all of that would be second copies in DTensor terms (its own grads as sharded DTensors, its
# own mixed precision, a state dict in DTensor shards our reshard cannot read without conversion); here ZeRO-3 is
# ZeRO-2 plus "free and gather the parameter buffer on demand", one file. The cost is measured against FSDP2 in
# benchmarks/zero3.py (same model, same 4 ranks).
#
# LoRA: frozen weights have no bucket, so they stay whole (replicated) on every rank; only the adapters are sharded.
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from runtime.parallel import collectives as C


def find_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, its parameters) per unit, in model order: every block (a child of a `layers` ModuleList or
    ModuleDict, once however many lists hold it), then each other module owning parameters directly."""
    blocks, seen = [], set()
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            for block in module.children():
                if id(block) not in seen:
                    seen.add(id(block))
                    blocks.append(block)
    units = [(block, list(block.parameters())) for block in blocks]
    done = {id(p) for block in blocks for p in block.parameters()}
    holds_blocks = {id(m) for m in model.modules() if any(id(b) in seen for b in m.modules())}

    def outside(module: nn.Module) -> None:
        # The outermost module around the rest: an embedding's parent reads its position table directly.
        for child in module.children():
            if id(child) in holds_blocks:
                outside(child)
            elif own := [p for p in child.parameters() if id(p) not in done]:
                done.update(id(p) for p in own)
                units.append((child, own))
        if own := [p for p in module.parameters(recurse=False) if id(p) not in done]:
            done.update(id(p) for p in own)
            units.append((module, own))

    outside(model)
    order = {id(p): i for i, p in enumerate(model.parameters())}
    return sorted(units, key=lambda unit: min((order.get(id(p), len(order)) for p in unit[1]), default=0))


def unit_index(model: nn.Module) -> dict[int, int]:
    """{id(parameter): its unit's index}: where data_parallel must cut buckets."""
    return {id(p): i for i, (_, params) in enumerate(find_units(model)) for p in params}


class _Unit:
    __slots__ = ("buckets", "uses", "seen", "held")

    def __init__(self, buckets: list, uses: int):
        self.buckets, self.uses = buckets, uses
        self.seen = 0     # parameters whose gradient this backward has accumulated
        self.held = 0     # backward passes holding the unit's buckets


class Zero3:
    """The gather / free schedule of one DataParallel at ZeRO-3 (see the header)."""

    def __init__(self, model: nn.Module, dp, aliases: list[tuple[nn.Parameter, nn.Parameter]]):
        self.dp = dp
        self.managed = [b for b in dp.buckets if b.shard_axis.size > 1]  # a group of one has nothing to shard
        for bucket in self.managed:
            bucket.param_shard = bucket.param_buffer[bucket.shard].clone()
        self._count = {id(b): 0 for b in self.managed}         # units holding each bucket now
        self._pending: dict[int, C.Pending] = {}                # id(bucket) -> its all-gather in flight
        self._full: set[int] = set()                            # buckets whose storage holds the full values
        owner = {id(alias): own for alias, own in aliases}
        bucket_of = {id(p): b for b in self.managed for p in b.params}
        self.units: list[_Unit] = []
        for module, params in find_units(model):
            trainable = [p for p in params if p.requires_grad]
            buckets = list({id(b): b for p in trainable
                            if (b := bucket_of.get(id(owner.get(id(p), p)))) is not None}.values())
            if not buckets:
                continue
            unit = _Unit(buckets, len(trainable))
            index = len(self.units)
            self.units.append(unit)
            module.register_forward_pre_hook(lambda *_, i=index: self._before_forward(i))
            module.register_forward_hook(lambda _m, _a, out, i=index: self._after_forward(i, out))
            for p in trainable:
                p.register_post_accumulate_grad_hook(lambda _p, u=unit: self._after_grad(u))
        for bucket in self.managed:
            self._free(bucket)

    # ---- one bucket: gather, wait, free ---------------------------------------------------------------------

    def _start(self, bucket) -> None:
        if id(bucket) in self._full or id(bucket) in self._pending:
            return
        buffer = bucket.param_buffer
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        self._pending[id(bucket)] = C.start_all_gather_flat(buffer, bucket.param_shard, bucket.shard_axis)

    def _ready(self, bucket) -> None:
        self._start(bucket)
        pending = self._pending.pop(id(bucket), None)
        if pending is not None:
            pending.wait()
            self._full.add(id(bucket))

    def _free(self, bucket) -> None:
        if (pending := self._pending.pop(id(bucket), None)) is not None:
            pending.wait()
        self._full.discard(id(bucket))
        bucket.param_buffer.untyped_storage().resize_(0)

    def _acquire(self, unit: _Unit) -> None:
        for bucket in unit.buckets:
            self._count[id(bucket)] += 1
            self._ready(bucket)

    def _release(self, unit: _Unit) -> None:
        for bucket in unit.buckets:
            self._count[id(bucket)] -= 1
            if self._count[id(bucket)] == 0:
                self._free(bucket)

    def _prefetch(self, index: int) -> None:
        if 0 <= index < len(self.units):
            for bucket in self.units[index].buckets:
                self._start(bucket)

    # ---- the hooks ------------------------------------------------------------------------------------------

    def _before_forward(self, index: int) -> None:
        self._acquire(self.units[index])
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            self._prefetch(index + 1)

    def _after_forward(self, index: int, out) -> None:
        unit = self.units[index]
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            register_multi_grad_hook(tensors, lambda _grad: self._before_backward(index), mode="any")
        self._release(unit)

    def _before_backward(self, index: int) -> None:
        unit = self.units[index]
        self._acquire(unit)
        unit.held += 1
        unit.seen = 0  # a backward that missed some parameter keeps its hold until release_all
        self._prefetch(index - 1)

    def _after_grad(self, unit: _Unit) -> None:
        unit.seen += 1
        if unit.seen == unit.uses and unit.held:
            unit.seen, unit.held = 0, unit.held - 1
            self._release(unit)

    # ---- outside forward and backward ----------------------------------------------------------------------

    def release_all(self) -> None:
        """End of backward (reduce_gradients): every bucket freed, every count back to zero."""
        for unit in self.units:
            unit.seen = unit.held = 0
        for bucket in self.managed:
            self._count[id(bucket)] = 0
            self._free(bucket)

    @contextlib.contextmanager
    def full_parameters(self, *, load: bool = False):
        """Every parameter whole for the duration (a state dict, an export). load: the body writes new values into
        the full buffers (a checkpoint load): nothing is gathered before, and each rank keeps its shard after."""
        for bucket in self.managed:
            if load:
                buffer = bucket.param_buffer
                buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
                self._full.add(id(bucket))
            else:
                self._ready(bucket)
        try:
            yield
        finally:
            for bucket in self.managed:
                if load:
                    bucket.param_shard.copy_(bucket.param_buffer[bucket.shard])
                if self._count[id(bucket)] == 0:
                    self._free(bucket)


def full_parameters(model: nn.Module, *, load: bool = False):
    """Zero3.full_parameters of the model's data parallelism; nothing to do below stage 3."""
    zero3 = getattr(getattr(model, "data_parallel", None), "zero3", None)
    return zero3.full_parameters(load=load) if zero3 is not None else contextlib.nullcontext()
