"""The pure rank arithmetic: groups for every axis, checked exhaustively up to 2048 ranks (no processes)."""
from __future__ import annotations

import pytest

from runtime.parallel import ParallelDims, coords_to_rank, rank_coords, rank_groups
from runtime.parallel.dims import context_coords, expert_coords

NODES, DEVICES = 64, 32  # a 2048-rank world: 64 nodes of 32 workers


@pytest.mark.parametrize("tp,pp", [(8, 4), (32, 1), (1, 1), (4, 16), (2, 8)])
def test_every_rank_in_exactly_one_group_per_axis(tp, pp):
    world = NODES * DEVICES
    dims = ParallelDims.infer_dp(tp=tp, pp=pp, world_size=world, devices_per_node=DEVICES)
    for axis, size in dims.sizes().items():
        groups = rank_groups(dims, axis)
        assert len(groups) == world // size
        assert all(len(group) == size for group in groups)
        members = sorted(rank for group in groups for rank in group)
        assert members == list(range(world)), f"{axis}: a rank is missing or in two groups"
        for group in groups:
            # Members differ only in this axis' coordinate, which runs 0..size-1 in order.
            coords = [rank_coords(rank, dims) for rank in group]
            assert [c[axis] for c in coords] == list(range(size))
            for other in dims.sizes():
                if other != axis:
                    assert len({c[other] for c in coords}) == 1


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_tensor_parallel_groups_stay_inside_a_node(tp):
    dims = ParallelDims.infer_dp(tp=tp, pp=2, world_size=NODES * DEVICES, devices_per_node=DEVICES)
    for group in rank_groups(dims, "tp"):
        assert group == list(range(group[0], group[0] + tp)), "TP ranks are consecutive"
        assert len({rank // DEVICES for rank in group}) == 1, f"TP group {group} crosses a node"


def test_order_is_tp_then_dp_then_pp():
    # Megatron's default 'tp-dp-pp' order, written out for a world of 8.
    dims = ParallelDims(tp=2, pp=2, dp=2, world_size=8)
    assert rank_groups(dims, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(dims, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(dims, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_coords(5, dims) == {"tp": 1, "dp": 0, "pp": 1}


def test_coords_round_trip():
    dims = ParallelDims(tp=4, pp=8, dp=64, world_size=2048)
    for rank in range(dims.world_size):
        assert coords_to_rank(**rank_coords(rank, dims), dims=dims) == rank


def test_mismatched_world_shows_the_arithmetic():
    with pytest.raises(ValueError, match=r"tp\(2\) \* pp\(1\) \* dp\(3\) = 6 != world_size\(4\)"):
        ParallelDims(tp=2, pp=1, dp=3, world_size=4)
    with pytest.raises(ValueError, match="the world size 6 is not divisible by tensor_model_parallel_size × pipeline_model_parallel_size = 4 × 1 = 4"):
        ParallelDims.infer_dp(tp=4, pp=1, world_size=6)


def test_tensor_parallel_wider_than_a_node_is_rejected():
    with pytest.raises(ValueError, match="tensor_model_parallel_size: 64 must divide trainer.devices 32"):
        ParallelDims(tp=64, pp=1, dp=32, world_size=2048, devices_per_node=32)


def test_unknown_axis_lists_the_axes():
    with pytest.raises(ValueError, match=r"\['tp', 'dp', 'pp', 'ep', 'edp', 'cp'\]"):
        rank_groups(ParallelDims(tp=1, pp=1, dp=1, world_size=1), "xp")


@pytest.mark.parametrize("tp,pp,dp,ep", [(8, 4, 64, 8), (32, 4, 16, 8), (1, 1, 4, 2), (2, 2, 2, 2), (4, 2, 8, 1)])
def test_expert_groups_split_every_dp_group(tp, pp, dp, ep):
    # 64 trn1 nodes x 32 workers = 2048 ranks among them.
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp, ep=ep)
    dp_of = {r: tuple(g) for g in rank_groups(dims, "dp") for r in g}
    ep_groups, edp_groups = rank_groups(dims, "ep"), rank_groups(dims, "edp")
    assert len(ep_groups) == dims.world_size // ep and all(len(g) == ep for g in ep_groups)
    assert len(edp_groups) == dims.world_size // (dp // ep) and all(len(g) == dp // ep for g in edp_groups)
    for axis, groups in (("ep", ep_groups), ("edp", edp_groups)):
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))  # each rank exactly once
        for g in groups:
            assert all(dp_of[r] == dp_of[g[0]] for r in g)  # inside one DP group: same tp and pp coordinates
            assert [expert_coords(r, dims)[axis] for r in g] == list(range(len(g)))
    for g in ep_groups:  # consecutive DP ranks
        dps = [rank_coords(r, dims)["dp"] for r in g]
        assert dps == list(range(dps[0], dps[0] + ep)) and dps[0] % ep == 0
    for g in edp_groups:  # same experts: same ep rank, DP ranks ep apart
        assert len({expert_coords(r, dims)["ep"] for r in g}) == 1
    # An EP group and an EDP group meet in exactly one rank when they share a DP group.
    for e in ep_groups[:50]:
        for d in edp_groups:
            if dp_of[d[0]] == dp_of[e[0]]:
                assert len(set(e) & set(d)) == 1


def test_expert_groups_by_hand():
    dims = ParallelDims(tp=2, pp=1, dp=4, world_size=8, ep=2)
    assert rank_groups(dims, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert rank_groups(dims, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(dims, "edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_coords(6, dims) == {"tp": 0, "dp": 3, "pp": 0} and expert_coords(6, dims) == {"ep": 1, "edp": 1}


def test_expert_parallel_must_divide_dp():
    with pytest.raises(ValueError, match="training.model.expert_model_parallel_size: 3 must divide the data-parallel size 4"):
        ParallelDims(tp=1, pp=1, dp=4, world_size=4, ep=3)


@pytest.mark.parametrize("tp,pp,dp,cp", [(8, 4, 64, 8), (32, 1, 64, 16), (1, 1, 4, 2), (2, 2, 2, 2), (8, 8, 32, 32)])
def test_context_groups_are_consecutive_dp_ranks_that_read_the_same_samples(tp, pp, dp, cp):
    # The context group is carved out of data parallelism: cp consecutive DP ranks, which read the same share of
    # every global batch (context_coords' 'data'); different groups of one DP group read different shares.
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp, cp=cp)
    groups = rank_groups(dims, "cp")
    assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
    dp_group_of = {r: tuple(g) for g in rank_groups(dims, "dp") for r in g}
    for group in groups:
        assert len(group) == cp
        assert set(group) <= set(dp_group_of[group[0]]), "a context group stays inside its DP group"
        assert [rank_coords(r, dims)["dp"] for r in group] == list(range(rank_coords(group[0], dims)["dp"],
                                                                          rank_coords(group[0], dims)["dp"] + cp))
        assert [context_coords(r, dims)["cp"] for r in group] == list(range(cp))
        assert len({context_coords(r, dims)["data"] for r in group}) == 1
    for dp_group in rank_groups(dims, "dp"):
        assert sorted({context_coords(r, dims)["data"] for r in dp_group}) == list(range(dp // cp))


def test_context_groups_by_hand():
    dims = ParallelDims(tp=2, pp=1, dp=4, world_size=8, cp=2)
    assert rank_groups(dims, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert rank_groups(dims, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="context_parallel_size: 3 must divide the data-parallel size 4"):
        ParallelDims(tp=2, pp=1, dp=4, world_size=8, cp=3)
