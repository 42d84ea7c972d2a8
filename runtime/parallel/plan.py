# The sharding plan: for every parameter of a parallelized model (by its name there), where its values sit in the
# unsharded model and which other ranks hold the same values. parallelize_model writes it; data parallelism, the
# optimizer's grad norm, checkpoints and the full-state gather read it. Nothing about parallelism is stored on
# the parameters themselves, so a module replaced or moved to another device keeps its plan.
#
# A parameter the plan does not name is whole, identical on every TP rank and has a full gradient (a norm weight
# without sequence parallelism, every parameter at tp = 1 outside a pipeline).
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Placement:
    """One parameter's place. Built by the tensor-parallel layers (runtime/parallel/layers.py) and parallelize."""

    dim: int | None = None              # TP-sharded along this dim of the full tensor (None: the whole tensor)
    index: torch.Tensor | None = None   # the full tensor's rows along `dim` this rank holds, in order
    full_size: int | None = None        # the full tensor's size along `dim`
    tp_copies: int | None = None        # TP ranks holding identical values: 1 when sharded, None for all of them
    partial_grad: bool = False          # replicated, but each rank's gradient covers only its sequence shard
    pipeline_tied: bool = False         # a tied embedding's copy on the first or the last pipeline stage
    source: str | None = None           # the parameter's own name in the unsharded module, where it differs
    # Expert parallelism: the experts (rows along dim 0 of the full tensor) this rank's EP group member holds;
    # the same values sit on every rank of the expert-data-parallel group instead of the whole DP group.
    experts: torch.Tensor | None = None
    num_experts: int | None = None

    @property
    def sharded(self) -> bool:
        """Split over tensor-parallel ranks."""
        return self.dim is not None

    @property
    def expert(self) -> bool:
        """Split over expert-parallel ranks (reduced over the expert-data-parallel group)."""
        return self.experts is not None


REPLICATED = Placement()


class ShardingPlan:
    """name in the parallelized model -> Placement. Where a tied embedding is one parameter under two names
    (`embed.word.weight`, `output.weight`) both names have the same entry; a pipeline stage keeps only the
    entries of the parameters it holds."""

    def __init__(self, tp_size: int = 1, placements: dict[str, Placement] | None = None):
        self.tp_size = tp_size
        self._placements: dict[str, Placement] = dict(placements or {})

    @classmethod
    def collect(cls, model: nn.Module, tp_size: int) -> "ShardingPlan":
        """The placements the model's parallel layers declare (their `placements`: local name -> Placement)."""
        plan = cls(tp_size)
        for prefix, module in model.named_modules(remove_duplicate=False):
            for local, placement in getattr(module, "placements", {}).items():
                plan._placements[f"{prefix}.{local}" if prefix else local] = placement
        return plan

    def __getitem__(self, name: str) -> Placement:
        return self._placements.get(name, REPLICATED)

    def __contains__(self, name: str) -> bool:
        return name in self._placements

    def items(self) -> Iterator[tuple[str, Placement]]:
        return iter(sorted(self._placements.items()))

    def keep_only(self, names) -> None:
        """Forget the parameters this rank does not hold (another pipeline stage's layers)."""
        names = set(names)
        self._placements = {k: v for k, v in self._placements.items() if k in names}

    def place(self, name: str, placement: Placement) -> None:
        """Record where a parameter a parallelization step sharded now lives (e.g. an expert-parallel shard)."""
        self._placements[name] = placement

    def mark(self, name: str, **changes) -> None:
        """Add to a parameter's placement, e.g. mark(name, partial_grad=True)."""
        self._placements[name] = dataclasses.replace(self[name], **changes)

    # ---- what the readers ask ------------------------------------------------------------------------------

    def full_name(self, name: str) -> str:
        """The parameter's name in the unsharded model (a replicated-KV projection's `kv_weight` is part of its
        module's `weight`)."""
        source = self[name].source
        return name if source is None else name.rsplit(".", 1)[0] + "." + source

    def full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        placement, shape = self[name], list(param.shape)
        if placement.sharded:
            shape[placement.dim] = placement.full_size
        if placement.expert:
            shape[0] = placement.num_experts
        return tuple(shape)

    def selection(self, name: str) -> dict[int, torch.Tensor]:
        """Which of the full tensor's indices this rank holds, per dim it does not hold whole: experts along
        dim 0, the TP shard's rows along its dim. The local tensor is the full one indexed by these, dim by dim."""
        placement, rows = self[name], {}
        if placement.expert:
            rows[0] = placement.experts.cpu()
        if placement.sharded:
            if placement.dim in rows:
                raise ValueError(f"{name}: experts and its TP rows are both along dim 0, which is not supported")
            rows[placement.dim] = placement.index.cpu()
        return rows

    def where(self, name: str, param: torch.Tensor) -> tuple[str, tuple[int, ...], dict[int, torch.Tensor]]:
        """(full name, full shape, selection): what runtime/models/init.py materializes a local parameter from."""
        return self.full_name(name), self.full_shape(name, param), self.selection(name)

    def tp_copies(self, name: str) -> int:
        """How many TP ranks hold this exact value (what a global norm divides a replicated square by)."""
        copies = self[name].tp_copies
        return self.tp_size if copies is None else copies

    def __repr__(self) -> str:
        lines = [f"ShardingPlan(tp={self.tp_size})"]
        for name, p in self.items():
            where = f"dim {p.dim} ({p.index.numel()}/{p.full_size} rows)" if p.sharded else "replicated"
            if p.expert:
                where = f"experts {p.experts.tolist()} of {p.num_experts}, " + where
            flags = [f for f, on in (("partial grad", p.partial_grad), ("pipeline tied", p.pipeline_tied)) if on]
            lines.append(f"  {name}: {where}" + (f", {p.tp_copies} tp copies" if p.tp_copies not in (None, 1) else "")
                         + "".join(f", {f}" for f in flags) + (f" (of {self.full_name(name)})" if p.source else ""))
        return "\n".join(lines)


def plan_of(model: nn.Module) -> ShardingPlan:
    """The model's plan; a model parallelize_model never saw is replicated everywhere."""
    plan = getattr(model, "sharding_plan", None)
    return plan if plan is not None else ShardingPlan()
