# The parallel layout (tp x dp x pp) and the pure rank arithmetic behind it: which global ranks form each
# tensor-, data- and pipeline-parallel group. No torch here (it lives in the torch-free schema so the launcher's
# estimator reads dp, edp and the batch-reading ranks from the same owner as the runtime's process groups,
# runtime/parallel/topology.py), so it is testable for any world size; runtime/parallel/dims.py exports it.
#
# Rank order is tp fastest, then dp, then pp (Megatron's default 'tp-dp-pp'):
#     rank = tp_rank + tp * (dp_rank + dp * pp_rank)
# Tensor-parallel groups are therefore runs of consecutive ranks. torchrun numbers ranks node by node, so as long
# as tp divides the devices per node, every TP group (the chattiest one: collectives inside every layer) stays
# inside one node; DP groups stride by tp and PP groups by tp*dp, crossing nodes where needed.
#
# Expert parallelism is carved out of data parallelism (Megatron's and NxD Training's layout): a DP index d is
# (edp_rank * ep + ep_rank), so an expert-parallel group is `ep` consecutive DP ranks (the all-to-all stays as
# close as DP allows) and an expert-data-parallel group is the DP ranks holding the same experts, striding by ep.
from __future__ import annotations

import dataclasses

from runtime.schema import rules

AXES = ("tp", "dp", "pp")
EXPERT_AXES = ("ep", "edp")
CONTEXT_AXIS = "cp"


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    tp: int
    pp: int
    dp: int
    world_size: int
    devices_per_node: int | None = None  # when given, TP groups are checked to stay inside a node
    ep: int = 1                           # expert-parallel size; divides dp
    cp: int = 1                           # context group size (ring or Ulysses); divides dp

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "dp", "world_size"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be >= 1, got {getattr(self, axis)}")
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(
                f"tp * pp * dp must equal the world size: tp({self.tp}) * pp({self.pp}) * dp({self.dp}) = "
                f"{self.tp * self.pp * self.dp} != world_size({self.world_size}); world_size is "
                f"trainer.num_nodes * trainer.devices, tp is model.tensor_model_parallel_size, "
                f"pp is model.pipeline_model_parallel_size")
        if problem := rules.ep_divides_dp(self.ep, self.dp, "training."):
            raise ValueError(problem)
        if problem := rules.context_layout(self.cp, 1, self.dp, "training."):
            raise ValueError(problem)
        if self.cp > 1 and self.ep > 1:
            raise ValueError("training.model.context_parallel_size: cannot be combined with "
                             "expert_model_parallel_size; set one of them to 1")
        if self.devices_per_node is not None and (problem := rules.tp_within_node(self.tp, self.devices_per_node,
                                                                                   "training.")):
            raise ValueError(problem)

    @classmethod
    def infer_dp(cls, tp: int, pp: int, world_size: int, devices_per_node: int | None = None,
                 ep: int = 1, cp: int = 1) -> "ParallelDims":
        """The usual case: data parallelism takes whatever tp and pp leave of the world."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp ({tp}) and pp ({pp}) must be >= 1")
        if problem := rules.world_divisible(world_size, f"the world size {world_size}", tp, pp, "training."):
            raise ValueError(problem)
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), world_size=world_size,
                   devices_per_node=devices_per_node, ep=ep, cp=cp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the data-parallel ranks holding the same experts (their expert gradients are
        reduced together, and ZeRO-1 shards the experts' optimizer state over them)."""
        return self.dp // self.ep

    @property
    def batch_dp(self) -> int:
        """Data-parallel ranks that read distinct samples: the ranks of a context group share theirs."""
        return self.dp // self.cp

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp}


def rank_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """Global rank -> its index along each axis: {'tp': .., 'dp': .., 'pp': ..}."""
    assert 0 <= rank < dims.world_size, (rank, dims)
    return {"tp": rank % dims.tp, "dp": (rank // dims.tp) % dims.dp, "pp": rank // (dims.tp * dims.dp)}


def expert_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """Global rank -> its index in its expert-parallel and expert-data-parallel groups: {'ep': .., 'edp': ..}."""
    dp = rank_coords(rank, dims)["dp"]
    return {"ep": dp % dims.ep, "edp": dp // dims.ep}


def context_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """Global rank -> {'cp': its place in its context group, 'data': which share of each global batch it reads}."""
    dp = rank_coords(rank, dims)["dp"]
    return {"cp": dp % dims.cp, "data": dp // dims.cp}


def coords_to_rank(tp: int, dp: int, pp: int, dims: ParallelDims) -> int:
    return tp + dims.tp * (dp + dims.dp * pp)


def rank_groups(dims: ParallelDims, axis: str) -> list[list[int]]:
    """All groups along `axis`: each is the ranks that differ only in that axis' coordinate, in axis order.

    Every rank appears in exactly one group per axis; groups are listed in a fixed order so every process
    creates them identically (dist.new_group must be called by all ranks in the same order).
    """
    if axis in EXPERT_AXES:
        return _expert_groups(dims, axis)
    if axis == CONTEXT_AXIS:
        return sorted(g[i:i + dims.cp] for g in rank_groups(dims, "dp") for i in range(0, dims.dp, dims.cp))
    if axis not in AXES:
        raise ValueError(f"axis {axis!r} is not one of {list(AXES + EXPERT_AXES) + [CONTEXT_AXIS]}")
    sizes = dims.sizes()
    others = [a for a in AXES if a != axis]
    groups = []
    # Iterate the other two axes slowest-first so the group list is ordered by its lowest rank.
    for outer in range(sizes[others[1]]):
        for inner in range(sizes[others[0]]):
            fixed = {others[1]: outer, others[0]: inner}
            groups.append([coords_to_rank(**{**fixed, axis: i}, dims=dims) for i in range(sizes[axis])])
    return sorted(groups)


def _expert_groups(dims: ParallelDims, axis: str) -> list[list[int]]:
    """Each DP group split into its expert-parallel groups (runs of ep consecutive DP ranks) or its
    expert-data-parallel groups (DP ranks ep apart)."""
    groups = []
    for dp_group in rank_groups(dims, "dp"):
        if axis == "ep":
            groups += [dp_group[i:i + dims.ep] for i in range(0, dims.dp, dims.ep)]
        else:
            groups += [dp_group[i::dims.ep] for i in range(dims.ep)]
    return sorted(groups)
