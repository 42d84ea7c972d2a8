# The one owner of process groups (habit 2 in STYLE.md): the world group is joined and left here (join_world,
# leave_world; runtime/device.py decides the backend and the rendezvous), and every tp/dp/pp group is built once
# from it and passed to whatever needs a group. No module-level group globals anywhere in the runtime.
from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import sys
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from runtime.parallel.dims import (AXES, CONTEXT_AXIS, EXPERT_AXES, ParallelDims, context_coords, expert_coords,
                                   rank_coords, rank_groups)


def join_world(backend: str, *, init_method: str | None = None, store=None, rank: int | None = None,
               world_size: int | None = None, device_id=None,
               timeout: datetime.timedelta | None = None) -> tuple[int, int]:
    """Join the default process group (once per process); returns (rank, world size)."""
    if not dist.is_initialized():
        # torch.distributed.nn.functional's functions take group=group.WORLD as a default argument, so importing
        # it once the world exists (torch's sharded-tensor code does, lazily) pins the world group in those
        # defaults for good, and leave_world could never free it. Imported before, the defaults hold None.
        import torch.distributed.nn.functional  # noqa: F401
        kwargs: dict[str, Any] = {"init_method": init_method} if store is None else {"store": store}
        if rank is not None:
            kwargs.update(rank=rank, world_size=world_size)
        if device_id is not None:
            kwargs["device_id"] = device_id  # binds NCCL's communicator to this rank's GPU up front
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(backend, **kwargs)
    return dist.get_rank(), dist.get_world_size()


def attempt_store(master_addr: str, master_port: int, rank: int, world_size: int, attempt: str, *,
                  agent_store: bool):
    """torchrun's rendezvous store under a prefix per restart attempt (see runtime/device.py for why)."""
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=not agent_store and rank == 0,
                          timeout=datetime.timedelta(minutes=30), multi_tenant=not agent_store)
    return dist.PrefixStore(f"nxdt/attempt_{attempt}", store)


def is_joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world_store():
    """The key-value store the default group rendezvoused through (None if there is none to reach)."""
    try:  # no public accessor for it
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a backend without one (or a future torch)
        return None


def world_barrier(device_ids: list[int] | None = None) -> None:
    dist.barrier(device_ids=device_ids) if device_ids is not None else dist.barrier()


def leave_world(*, drain: bool = True) -> int:
    """Leave the default group and release every group Topology.build made; returns how many groups are still
    held somewhere (0 after a clean run: the test harness asserts it).

    drain: wait until the groups' worker threads have finished and exited. Why: gloo finishes each collective
    on a worker thread of its own, and the last reference to the tensors a collective used can be dropped
    there, which takes the GIL. If that happens once the interpreter has begun to finalize, CPython ends the
    thread with pthread_exit, the forced unwind crosses a noexcept destructor, and the process aborts with
    "terminate called without an active exception" although the run succeeded. A barrier makes it likely: it
    holds weak references to the work in flight when it was issued, so that work's tensors are dropped only
    with the barrier's own work, just after every rank has passed it and may already be exiting. Freeing a
    group joins its workers (the bindings let go of the GIL while they do), so after this no worker is left
    to race the interpreter's exit. Off on error paths: a worker still inside a collective a dead peer will
    never finish would hold the join until gloo's timeout."""
    global _host_staging
    if dist.is_initialized():
        dist.destroy_process_group()
    _host_staging = None
    if not drain:
        return 0
    for ref in _axes:
        if (axis := ref()) is not None:
            object.__setattr__(axis, "group", None)  # frozen for callers; the groups are gone now
    _axes.clear()
    gc.collect()  # groups referenced only from cycles (a model's hooks) are freed now, not at finalization
    alive = sum(ref() is not None for ref in _groups)
    _groups.clear()
    if alive or backend_threads():
        print(f"nxdt: warning: {alive} process groups are still referenced after leaving the world and "
              f"{len(backend_threads())} of their threads still run: they may abort this process's exit",
              file=sys.stderr, flush=True)
    return alive


def backend_threads() -> list[str]:
    """The names of this process's threads that belong to a gloo process group (its workers and transport
    loops), from /proc; [] where there is no /proc. After leave_world() there must be none."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return [name for name in names if name.startswith(("pt_gloo", "gloo_"))]


# What Topology.build handed out, so that leave_world can release it: a weak reference to each AxisGroup (their
# groups are set to None there) and to each group, to count the ones something else still holds. Weak: a
# long-lived process (a test session, a notebook) that builds many topologies must not keep them all.
_axes: list[weakref.ref] = []
_groups: list[weakref.ref] = []


def _register(axis: "AxisGroup") -> "AxisGroup":
    _axes[:] = [ref for ref in _axes if ref() is not None]
    _axes.append(weakref.ref(axis))
    _groups[:] = [ref for ref in _groups if ref() is not None]
    if axis.group is not None and not any(ref() is axis.group for ref in _groups):
        _groups.append(weakref.ref(axis.group))
    return axis


# Whether a collective has to copy a tensor through host memory because the group's backend cannot address the
# tensor's device (gloo over XLA tensors). runtime/device.py knows the devices and hands the rule in when it joins
# the world; this module and the collectives only apply it. Without one (a harness joining by itself), never.
_host_staging: Callable[[torch.Tensor, str], bool] | None = None


def use_host_staging(rule: Callable[[torch.Tensor, str], bool]) -> None:
    """rule(tensor, backend) -> whether `tensor` must be staged through host memory for that backend."""
    global _host_staging
    _host_staging = rule


def needs_host_staging(tensor: torch.Tensor, group=None) -> bool:
    return _host_staging is not None and _host_staging(tensor, dist.get_backend(group))


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
    # Expert parallelism, carved out of dp: the ranks sharing out the experts (tokens go round them by
    # all-to-all), and the ranks holding the same experts (their gradients are summed there). Without expert
    # parallelism ep is a group of one and edp is dp itself.
    ep: AxisGroup | None = None
    edp: AxisGroup | None = None
    # The context group, carved out of dp too: the ranks that split each sequence (ring attention or Ulysses).
    # A group of one without it.
    cp: AxisGroup | None = None
    # Hybrid sharding (model.data_parallel_shard_degree, torchtitan's HSDP): ZeRO shards within groups of that many
    # consecutive dp (edp) ranks and replicates across them; the replica group is the ranks holding the same
    # shard. Without it the shard group is dp (edp) itself and the replica group is one rank.
    dp_shard: AxisGroup | None = None
    dp_replica: AxisGroup | None = None
    edp_shard: AxisGroup | None = None
    edp_replica: AxisGroup | None = None

    def __post_init__(self) -> None:
        one = AxisGroup(rank=0, size=1, ranks=(self.rank,), group=None)
        for axis in ("ep", "cp", "dp_replica"):
            if getattr(self, axis) is None:
                object.__setattr__(self, axis, one)
        if self.dp_shard is None:
            object.__setattr__(self, "dp_shard", self.dp)
        if self.edp is None:  # no expert parallelism: the experts' groups are dp's
            object.__setattr__(self, "edp", self.dp)
            object.__setattr__(self, "edp_shard", self.dp_shard)
            object.__setattr__(self, "edp_replica", self.dp_replica)
        if self.edp_shard is None:
            object.__setattr__(self, "edp_shard", self.edp)
        if self.edp_replica is None:
            object.__setattr__(self, "edp_replica", one)

    def shard_axes(self, axis: AxisGroup) -> tuple[AxisGroup, AxisGroup]:
        """(shard group, replica group) of `axis`, this topology's dp or edp."""
        return (self.edp_shard, self.edp_replica) if axis is self.edp else (self.dp_shard, self.dp_replica)

    @classmethod
    def build(cls, dims: ParallelDims, shard_degree: int | None = None) -> "Topology":
        """Create every tp/dp/pp group (all ranks must call this, in the same order) and keep this rank's.
        shard_degree: hybrid sharding's shard group size (None: all of dp)."""
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
        coords = {**rank_coords(rank, dims), **expert_coords(rank, dims), **context_coords(rank, dims)}
        mine = {}
        for axis in AXES + (EXPERT_AXES if dims.ep > 1 else ()) + ((CONTEXT_AXIS,) if dims.cp > 1 else ()):
            for ranks in rank_groups(dims, axis):
                # new_group is collective over the whole world: every process creates every group.
                group = dist.new_group(ranks) if len(ranks) < dims.world_size else dist.group.WORLD
                if rank in ranks:
                    mine[axis] = _register(AxisGroup(rank=coords[axis], size=len(ranks), ranks=tuple(ranks),
                                                     group=group))
        if dims.pp > 1:
            for ranks in rank_groups(dims, "pp"):
                ends = [ranks[0], ranks[-1]]
                group = dist.new_group(ends) if len(ends) < dims.world_size else dist.group.WORLD
                if rank in ends:
                    mine["embedding"] = _register(AxisGroup(rank=ends.index(rank), size=2, ranks=tuple(ends),
                                                          group=group))
        for name, ranks in _hybrid_groups(dims, shard_degree):
            group = dist.new_group(ranks) if len(ranks) < dims.world_size else dist.group.WORLD
            if rank in ranks:
                mine[name] = _register(AxisGroup(rank=ranks.index(rank), size=len(ranks), ranks=tuple(ranks),
                                                 group=group))
        return cls(dims=dims, rank=rank, **mine)

    @classmethod
    def offline(cls, dims: ParallelDims, rank: int, shard_degree: int | None = None) -> "Topology":
        """Rank `rank`'s place in `dims` with no process groups: enough to shard a model on the meta device and
        see what that rank would hold (sizes, tests) without starting the other ranks. Collectives fail on it."""
        coords = {**rank_coords(rank, dims), **expert_coords(rank, dims), **context_coords(rank, dims)}
        mine = {}
        for axis in AXES + (EXPERT_AXES if dims.ep > 1 else ()) + ((CONTEXT_AXIS,) if dims.cp > 1 else ()):
            ranks = next(r for r in rank_groups(dims, axis) if rank in r)
            mine[axis] = AxisGroup(rank=coords[axis], size=len(ranks), ranks=tuple(ranks), group=None)
        for name, ranks in _hybrid_groups(dims, shard_degree):
            if rank in ranks:
                mine[name] = AxisGroup(rank=ranks.index(rank), size=len(ranks), ranks=tuple(ranks), group=None)
        return cls(dims=dims, rank=rank, **mine)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def data_rank(self) -> int:
        """Which share of each global batch this rank reads: DP ranks of one context group read the same one."""
        return self.dp.rank // self.cp.size

    @property
    def data_size(self) -> int:
        """How many shares each global batch is cut into (the data-parallel size without the context groups)."""
        return self.dp.size // self.cp.size

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of the previous pipeline stage (the last one for the first stage: virtual stages wrap)."""
        return self.pp.ranks[(self.pp.rank - 1) % self.pp.size]

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (the first one for the last stage: virtual stages wrap)."""
        return self.pp.ranks[(self.pp.rank + 1) % self.pp.size]

    def __repr__(self) -> str:
        ep = f", ep={self.ep.rank}/{self.ep.size}" if self.ep.size > 1 else ""
        cp = f", cp={self.cp.rank}/{self.cp.size}" if self.cp.size > 1 else ""
        return (f"Topology(rank={self.rank}, tp={self.tp.rank}/{self.tp.size}, dp={self.dp.rank}/{self.dp.size}, "
                f"pp={self.pp.rank}/{self.pp.size}{ep}{cp})")


def hybrid_groups(ranks: list[int], degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """One dp (or edp) group's ranks, in axis order, cut for hybrid sharding: (shard groups, replica groups).
    A shard group is `degree` consecutive ranks of the axis (dp ranks are consecutive up to tp: with tp x degree
    dividing the devices per node, a shard group is node-local, torchrun numbering ranks node by node); a replica
    group is the ranks at the same place of every shard group."""
    if degree < 1 or len(ranks) % degree:
        raise ValueError(f"model.data_parallel_shard_degree: {degree} must divide the group's {len(ranks)} ranks")
    shards = [ranks[i:i + degree] for i in range(0, len(ranks), degree)]
    return shards, [ranks[i::degree] for i in range(degree)]


def _hybrid_groups(dims: ParallelDims, degree: int | None) -> list[tuple[str, list[int]]]:
    """Every hybrid sub-group to create, in one order on every rank: (dp_shard, dp_replica, edp_shard or
    edp_replica, its ranks). None, or a degree equal to the group size: nothing to create (and no edp groups of
    their own without expert parallelism: edp is dp)."""
    out = []
    for axis in ("dp", "edp"):
        size = dims.dp if axis == "dp" else dims.edp
        if degree is None or degree == size or (axis == "edp" and dims.ep == 1):
            continue
        for ranks in rank_groups(dims, axis):
            shards, replicas = hybrid_groups(ranks, degree)
            out += [(f"{axis}_shard", group) for group in shards] + [(f"{axis}_replica", group) for group in replicas]
    return out
