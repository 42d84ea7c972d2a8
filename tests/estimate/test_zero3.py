"""ZeRO-3 and hybrid sharding in the estimator: per-rank weights, gradients and optimizer state over the shard group
plus two gathered units; the step's parameter all-gathers (forward and backward of every micro-batch) and hybrid's
all-reduce across replicas; every stage equal where there is nothing to shard (dp 1)."""

import dataclasses

import pytest

from launcher.estimator import estimate
from launcher.estimator.compute import step_time
from launcher.estimator.hardware import HARDWARE
from launcher.estimator.host import host_memory
from launcher.estimator.memory import peak_memory, pipeline_stages
from launcher.estimator.shapes import count_parameters, layer_parameters
from runtime.schema.facts import checkpoint_staging_bytes
from tests.estimate.test_estimator import GPT3_175B, LLAMA3_70B, layout
from tests.launcher.helpers import resolved

H100 = HARDWARE["h100"]
# 8 nodes of 8, tp 8: dp 8 over nodes (tp x dp = 64 > 8 devices per node: inter-node bandwidth); one micro-batch a
# step (ZeRO-2/3 shard the gradients only then: accumulation keeps the full buffers).
DP8 = layout(num_nodes=8, tp=8, zero1=True, global_batch_size=8)


def _at(stage: int, base=DP8, **changes):
    return dataclasses.replace(base, zero_stage=stage, **changes)


def test_zero3_shards_the_weights_and_holds_two_gathered_units():
    zero2, zero3 = (peak_memory(LLAMA3_70B, _at(s)) for s in (2, 3))
    params, h, v = zero3.parameters, LLAMA3_70B.hidden_size, LLAMA3_70B.vocab_size
    unit = max(layer_parameters(LLAMA3_70B, 8), v // 8 * h)  # a block, the embedding or the head: a tp-th each
    assert unit == v // 8 * h  # Llama 3's 128k vocabulary: the embedding is the largest unit
    assert zero3.gathered == 2 * 2 * unit  # two units (computing, prefetched), bf16
    assert zero3.weights == pytest.approx(2 * params / 8 + 2 * 2 * unit)
    assert zero3.gradients == zero2.gradients == pytest.approx(4 * params / 8)
    assert zero3.optimizer == zero2.optimizer == pytest.approx(12 * params / 8)
    assert zero2.weights == 2 * params
    assert zero2.total - zero3.total == pytest.approx(2 * params * 7 / 8 - 4 * unit)
    assert zero3.total < zero2.total
    accumulating = peak_memory(LLAMA3_70B, _at(3, global_batch_size=64))  # 8 micro-batches: gradients whole
    assert accumulating.gradients == 4 * params and accumulating.optimizer == zero3.optimizer


def test_one_data_parallel_rank_holds_the_same_at_every_stage():
    single = layout(tp=8)  # 8 devices, tp 8: dp 1
    stages = [peak_memory(LLAMA3_70B, _at(s, single, zero1=s >= 1)) for s in range(4)]
    assert {m.total for m in stages} == {stages[0].total} and stages[3].gathered == 0.0
    times = [step_time(LLAMA3_70B, _at(s, single, zero1=s >= 1), H100, 0.4) for s in range(4)]
    assert {t.total_s for t in times} == {times[0].total_s} and times[3].data_parallel_s == 0.0


def _dense_per_device(shape, base) -> float:
    return count_parameters(shape).total / (base.tp * base.pp)


def test_zero3_gathers_forward_and_backward_of_every_micro_batch():
    """2 x micro-batches ring all-gathers of the weights at bf16 over dp, on top of ZeRO-2's reduce-scatter and
    all-gather; full recompute gathers nothing more (backward's gather serves the rebuilt forward)."""
    m, gbps = 8, H100.inter_node_gbps * 1e9
    zero2, zero3 = (step_time(LLAMA3_70B, _at(s, global_batch_size=8 * m), H100, 0.4) for s in (2, 3))
    params = _dense_per_device(LLAMA3_70B, DP8)
    one_gather = 7 / 8 * 2 * params / gbps
    assert zero3.param_gather_s == pytest.approx(2 * m * one_gather)
    assert zero3.data_parallel_s == pytest.approx(zero2.data_parallel_s - one_gather + 2 * m * one_gather)
    assert zero2.param_gather_s == 0.0
    assert step_time(LLAMA3_70B, _at(3), H100, 0.4).param_gather_s == pytest.approx(2 * one_gather)  # m = 1
    recomputed = step_time(LLAMA3_70B, _at(3, recompute="full", global_batch_size=8 * m), H100, 0.4)
    assert recomputed.param_gather_s == zero3.param_gather_s
    # Grows with the weights: GPT-3 175B against Llama 3 70B, in proportion to their parameters per device.
    bigger = step_time(GPT3_175B, _at(3, global_batch_size=8 * m), H100, 0.4)
    assert bigger.param_gather_s / zero3.param_gather_s == pytest.approx(
        _dense_per_device(GPT3_175B, DP8) / params)


def test_hybrid_sharding_divides_by_the_shard_group_and_all_reduces_across_replicas():
    hybrid = _at(3, shard_degree=4)  # shard groups of 4 dp ranks (32 devices: over nodes), 2 replicas
    assert (hybrid.shard, hybrid.dp) == (4, 8)
    full, half, none = (peak_memory(LLAMA3_70B, _at(3, shard_degree=s)) for s in (None, 4, 1))
    params = half.parameters
    assert half.optimizer == pytest.approx(12 * params / 4) and half.gradients == pytest.approx(4 * params / 4)
    assert half.weights == pytest.approx(2 * params / 4 + full.gathered)
    assert full.total < half.total < none.total  # shard groups of 8, 4, 1 (a group of one: ZeRO-0's memory)
    assert none.total == peak_memory(LLAMA3_70B, _at(0, zero1=False)).total
    step = step_time(LLAMA3_70B, hybrid, H100, 0.4)
    p, gbps = _dense_per_device(LLAMA3_70B, DP8), H100.inter_node_gbps * 1e9
    reduce_scatter, replicas = 3 / 4 * 4 * p / gbps, 2 * (1 / 2) * 4 * p / 4 / gbps
    gathers = 2 * 1 * 3 / 4 * 2 * p / gbps  # forward and backward of the step's one micro-batch
    assert step.param_gather_s == pytest.approx(gathers)
    assert step.data_parallel_s == pytest.approx(reduce_scatter + replicas + gathers)
    # Shard groups inside a node (tp 1, groups of 8 on 8-device nodes) use the node's links, the replicas not.
    local = layout(num_nodes=4, tp=1, zero1=True, zero_stage=2, shard_degree=8)
    n = count_parameters(LLAMA3_70B).total
    expected = (7 / 8 * 4 * n / (H100.intra_node_gbps * 1e9) + 2 * 3 / 4 * 4 * n / 8 / (H100.inter_node_gbps * 1e9)
                + 7 / 8 * 2 * n / (H100.intra_node_gbps * 1e9))
    assert step_time(LLAMA3_70B, local, H100, 0.4).data_parallel_s == pytest.approx(expected)


def test_lora_bases_stay_whole_and_checkpoints_stage_the_rank_s_own_range():
    lora = pipeline_stages(LLAMA3_70B, _at(3), lora=True)[0]
    assert lora.weights == 2 * lora.parameters and lora.gathered == 0.0 and lora.optimizer == 0.0
    host = host_memory(LLAMA3_70B, _at(3), H100)
    held = peak_memory(LLAMA3_70B, _at(3))
    assert host.staging == checkpoint_staging_bytes(held.weights - held.gathered + held.optimizer,
                                                    state_on_host=False)


def test_the_estimate_reads_the_shard_degree_from_the_config():
    training = resolved("training=gpt3/tiny")["training"]
    training["trainer"].update(num_nodes=4, devices=2)
    training["model"].update(zero_stage=3, zero1=True, data_parallel_shard_degree=2)
    result = estimate(training, vocab_size=4096)
    assert (result.layout.shard, result.layout.dp, result.layout.zero_stage) == (2, 8, 3)
    training["model"]["data_parallel_shard_degree"] = None
    assert estimate(training, vocab_size=4096).layout.shard == 8
