"""The pure rank arithmetic: groups for every axis, checked exhaustively up to 2048 ranks (no processes)."""
from __future__ import annotations

import pytest

from runtime.parallel import ParallelDims, coords_to_rank, rank_coords, rank_groups

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
    with pytest.raises(ValueError, match=r"\['tp', 'dp', 'pp'\]"):
        rank_groups(ParallelDims(tp=1, pp=1, dp=1, world_size=1), "ep")
