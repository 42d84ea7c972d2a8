"""Hybrid sharding (model.data_parallel_shard_degree, torchtitan's HSDP): at dp4 with a shard degree of 2, ZeRO-1,
2 and 3 shard within pairs of data-parallel ranks and replicate across the two pairs; training equals one process
(fp32, losses within 1e-6 relative) for Llama and an MoE (ep2: the experts' own groups sharded the same way), and a
checkpoint saved at hybrid ZeRO-3 resumes at ZeRO-1 dp2. One spawn of four ranks (a second world size for the
resume). The pure rank arithmetic is checked without processes.
"""
from __future__ import annotations

import functools

import pytest
import torch

from runtime.parallel.topology import hybrid_groups
from runtime.schema.model import MoEConfig
from tests.checkpoint import harness as CH
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

L = H.Layout
MOE = MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02, router_z_loss_coef=0.001)
JOBS = {f"{name}-dp4-shard2-zero{stage}{'-ep2' if moe else ''}": (
            "llama", {"moe": MOE} if moe else {}, L(dp=4, ep=2 if moe else 1, zero_stage=stage, shard_degree=2))
        for name, moe in (("llama", False), ("mixtral", True)) for stage in (1, 2, 3)}


def _four_ranks(directory: str) -> dict:
    return {**H.run_suite(JOBS), **CH.suite("llama", CH.L(zero_stage=3, shard_degree=2),
                                             [CH.L(zero_stage=1, shard_degree=2), CH.L(zero_stage=2)], directory)}


def _two_ranks(directory: str) -> dict:
    return {target: CH.resume_and_step("llama", CH.L(zero_stage=1), directory, CH.STEPS, one_replica=one)
            for target, one in (("one_replica", True),)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hybrid"))
    return directory, run_distributed(_four_ranks, 4, args=(directory,))


@functools.cache
def reference(arch: str, overrides: tuple) -> dict:
    torch.set_num_threads(1)
    return H.train_job(arch, dict(overrides), H.Layout())


def test_hybrid_groups_are_consecutive_shards_and_strided_replicas():
    assert hybrid_groups([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # dp ranks of a tp2 layout stride by 2: a shard group of 2 is 4 consecutive global ranks (node-local)
    assert hybrid_groups([0, 2, 4, 6, 8, 10, 12, 14], 2)[0] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    with pytest.raises(ValueError, match="data_parallel_shard_degree: 3 must divide"):
        hybrid_groups([0, 1, 2, 3], 3)


@pytest.mark.parametrize("name", list(JOBS))
def test_hybrid_trains_as_one_process(name, four_ranks):
    arch, overrides, _ = JOBS[name]
    ref = reference(arch, tuple(sorted(overrides.items())))
    for rank in four_ranks[1]:
        rank = rank[name]
        torch.testing.assert_close(torch.tensor(rank["losses"], dtype=torch.float64),
                                   torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-6, atol=0)
        H.assert_trains_as_reference(rank, ref)
        for key, value in rank["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=1e-5, atol=1e-5, msg=key)


def test_hybrid_groups_of_experts_are_cut_within_their_own_group():
    from runtime.parallel import ParallelDims, Topology
    dims = ParallelDims(tp=1, pp=1, dp=8, world_size=8, ep=2)  # edp groups: [0, 2, 4, 6] and [1, 3, 5, 7]
    topo = Topology.offline(dims, 5, shard_degree=2)
    assert (topo.dp_shard.ranks, topo.dp_replica.ranks) == ((4, 5), (1, 3, 5, 7))
    assert (topo.edp_shard.ranks, topo.edp_replica.ranks) == ((5, 7), (1, 5))
    assert topo.shard_axes(topo.edp) == (topo.edp_shard, topo.edp_replica)


def test_hybrid_zero3_checkpoint_resumes_at_another_stage_dp4(four_ranks):
    for rank in four_ranks[1]:  # the same shard groups (bitwise), then plain ZeRO-2 (another reduction order)
        assert rank["tp1_pp1_zero_stage1_shard2"]["next_loss"] == rank["saved"]["next_loss"]
        assert rank["tp1_pp1_zero_stage2"]["next_loss"] == pytest.approx(rank["saved"]["next_loss"], rel=1e-6)


def test_hybrid_zero3_checkpoint_resumes_at_zero1_dp2(four_ranks):
    directory, ranks = four_ranks
    resumed = run_distributed(_two_ranks, 2, args=(directory,))
    for rank in resumed:  # another dp: another reduction order, so within float rounding
        assert rank["one_replica"]["next_loss"] == pytest.approx(ranks[0]["saved"]["next_loss"], rel=1e-6)
        assert rank["one_replica"]["optimizer_step"] == CH.STEPS


def test_shard_degree_rule_names_the_group_it_does_not_divide():
    from runtime.schema import rules
    assert rules.shard_degree(None, 0, 4, 4, "") is None and rules.shard_degree(2, 3, 8, 4, "") is None
    assert "expert-data-parallel ranks (data-parallel 8 / expert_model_parallel_size 4)" in rules.shard_degree(
        4, 1, 8, 2, "")
