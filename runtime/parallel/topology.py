# The one owner of process groups (habit 2 in STYLE.md): built once after init_process_group, passed to whatever
# needs a group. No module-level group globals anywhere in the runtime.
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from runtime.parallel.dims import AXES, ParallelDims, rank_coords, rank_groups


@dataclasses.dataclass(frozen=True)
class AxisGroup:
    """This rank's group along one axis. `group` is None only in a single-process run without torch.distributed."""

    rank: int           # index within the group
    size: int
    ranks: tuple[int, ...]  # global ranks, in axis order
    group: Any


@dataclasses.dataclass(frozen=True)
class Topology:
    dims: ParallelDims
    rank: int
    tp: AxisGroup
    dp: AxisGroup
    pp: AxisGroup
    # First and last pipeline stage of this rank's pp group, which both hold a tied embedding (None unless pp > 1).
    embedding: AxisGroup | None = None

    @classmethod
    def build(cls, dims: ParallelDims) -> "Topology":
        """Create every tp/dp/pp group (all ranks must call this, in the same order) and keep this rank's."""
        if not dist.is_available() or not dist.is_initialized():
            if dims.world_size != 1:
                raise ValueError(f"Topology.build needs torch.distributed initialized for world_size "
                                 f"{dims.world_size}; call dist.init_process_group first")
            solo = AxisGroup(rank=0, size=1, ranks=(0,), group=None)
            return cls(dims=dims, rank=0, tp=solo, dp=solo, pp=solo)
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"ParallelDims.world_size={dims.world_size} but torch.distributed has "
                             f"{dist.get_world_size()} processes")
        rank = dist.get_rank()
        coords = rank_coords(rank, dims)
        mine = {}
        for axis in AXES:
            for ranks in rank_groups(dims, axis):
                # new_group is collective over the whole world: every process creates every group.
                group = dist.new_group(ranks) if len(ranks) < dims.world_size else dist.group.WORLD
                if rank in ranks:
                    mine[axis] = AxisGroup(rank=coords[axis], size=len(ranks), ranks=tuple(ranks), group=group)
        if dims.pp > 1:
            for ranks in rank_groups(dims, "pp"):
                ends = [ranks[0], ranks[-1]]
                group = dist.new_group(ends) if len(ends) < dims.world_size else dist.group.WORLD
                if rank in ends:
                    mine["embedding"] = AxisGroup(rank=ends.index(rank), size=2, ranks=tuple(ends), group=group)
        return cls(dims=dims, rank=rank, **mine)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of the previous pipeline stage (the last one for the first stage: virtual stages wrap)."""
        return self.pp.ranks[(self.pp.rank - 1) % self.pp.size]

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (the first one for the last stage: virtual stages wrap)."""
        return self.pp.ranks[(self.pp.rank + 1) % self.pp.size]

    @property
    def is_distributed(self) -> bool:
        return self.tp.group is not None

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}, tp={self.tp.rank}/{self.tp.size}, dp={self.dp.rank}/{self.dp.size}, "
                f"pp={self.pp.rank}/{self.pp.size})")
