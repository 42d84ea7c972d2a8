"""The estimator's arithmetic: parameter counts by hand, FLOPs against the runtime's formula, ZeRO-1, pipeline and
sequence-parallel effects, recompute, and Korthikanti et al.'s per-layer activation formulas."""

import dataclasses

import pytest

from launcher.estimator import estimate
from launcher.estimator.compute import days_to_train, flops_per_token, six_n_t_parameters, step_time
from launcher.estimator.hardware import HARDWARE
from launcher.estimator.memory import (Kernels, in_flight_micro_batches, layer_activation_bytes, peak_memory,
                                      stage_memory)
from launcher.estimator.shapes import Layout, ModelShape, count_parameters, layer_parameters, padded_vocab
from tests.estimate.test_moe import MIXTRAL_8X7B
from tests.launcher.helpers import resolved

GPT3_175B = ModelShape("gpt", 96, 12288, 4 * 12288, 96, 96, padded_vocab(50257, 128), 2048, 2048, True)
LLAMA3_70B = ModelShape("llama", 80, 8192, 28672, 64, 8, padded_vocab(128256, 128), 8192, 8192, False)


def layout(**changes) -> Layout:
    base = Layout(num_nodes=1, devices_per_node=8, tp=1, pp=1, vpp=1, micro_batch_size=1, global_batch_size=64,
                  sequence_parallel=False, zero1=False, recompute=None, recompute_modules=(),
                  precision="mixed_precision")
    return dataclasses.replace(base, **changes)


def test_gpt3_175b_parameters_by_hand():
    h, L, V, s = 12288, 96, 50304, 2048
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h  # qkv proj fc1 fc2 LN
    expected = L * per_layer + V * h + s * h + 2 * h  # layers, tied embedding, positions, final LayerNorm
    assert count_parameters(GPT3_175B).total == expected == 174_604_836_864
    assert abs(expected / 175e9 - 1) < 0.01


def test_llama3_70b_parameters_by_hand():
    h, L, V, f, kv = 8192, 80, 128256, 28672, 8 * 128
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h  # q,k,v; o; gate, up, down; two RMSNorms
    expected = L * per_layer + 2 * V * h + h  # untied embedding and output, final RMSNorm
    assert count_parameters(LLAMA3_70B).total == expected == 70_553_706_496
    assert round(expected / 1e9, 1) == 70.6


@pytest.mark.parametrize("recipe", ["gpt3/tiny", "llama/tiny"])
def test_parameter_count_and_flops_match_the_runtime(recipe):
    from runtime.metrics import model_flops_per_token
    from runtime.models import ModelConfig, build_model

    training = resolved(f"training={recipe}")["training"]
    result = estimate(training, vocab_size=4096)
    shape = result.shape
    model = build_model(ModelConfig(architecture=shape.architecture, vocab_size=shape.vocab_size,
                                    hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                                    num_attention_heads=shape.num_attention_heads,
                                    ffn_hidden_size=shape.ffn_hidden_size,
                                    max_position_embeddings=shape.max_position_embeddings,
                                    num_query_groups=shape.num_query_groups,
                                    share_embeddings_and_output_weights=shape.tied_embeddings))
    assert result.parameters.total == model.num_params()
    assert flops_per_token(shape) == model_flops_per_token(model.cfg, shape.seq_length)


def test_zero1_shards_only_the_optimizer_state():
    plain = peak_memory(LLAMA3_70B, layout(num_nodes=32, tp=8, pp=8))                # dp = 256 / 64 = 4
    sharded = peak_memory(LLAMA3_70B, layout(num_nodes=32, tp=8, pp=8, zero1=True))
    assert sharded.weights == plain.weights and sharded.gradients == plain.gradients
    assert sharded.optimizer == pytest.approx(plain.optimizer / 4)
    assert plain.optimizer == pytest.approx(plain.parameters * 12)  # fp32 master + two fp32 moments


def test_zero2_shards_the_gradients_too():
    """Where a step is one micro-batch: with accumulation the full buffers stay through the step (memory.py)."""
    one = layout(num_nodes=32, tp=8, pp=8, zero1=True, global_batch_size=4)           # dp = 4, one micro-batch
    zero1 = peak_memory(LLAMA3_70B, one)
    zero2 = peak_memory(LLAMA3_70B, dataclasses.replace(one, zero_stage=2))
    assert zero2.gradients == pytest.approx(zero1.gradients / 4) and zero2.optimizer == zero1.optimizer
    assert zero2.weights == zero1.weights
    accumulating = peak_memory(LLAMA3_70B, dataclasses.replace(one, zero_stage=2, global_batch_size=64))
    assert accumulating.gradients == 4 * accumulating.parameters  # the peak stage's, whole
    moe = layout(num_nodes=4, tp=1, pp=1, ep=4, zero1=True, global_batch_size=32)   # dp 32, edp 8
    moe_zero1, moe_zero2 = (peak_memory(MIXTRAL_8X7B, dataclasses.replace(moe, zero_stage=s)) for s in (1, 2))
    assert moe_zero1.gradients == 4 * moe_zero1.parameters
    # dense gradients over dp, experts' over the expert-data-parallel group
    expected = 4 * ((moe_zero1.parameters - moe_zero1.expert_parameters) / 32 + moe_zero1.expert_parameters / 8)
    assert moe_zero2.gradients == pytest.approx(expected)


def test_pipeline_splits_parameters_and_holds_micro_batches_in_flight():
    pp4 = layout(num_nodes=32, tp=8, pp=4, global_batch_size=256)                   # dp 8, 32 micro-batches
    # 1F1B: the first stage holds pp micro-batches of its L/pp layers (as much as one micro-batch of all layers);
    # fewer when the step has fewer micro-batches; the interleaved schedule (1 + (pp - 1) / (pp * vpp)) times more.
    assert in_flight_micro_batches(pp4) == 4
    assert in_flight_micro_batches(dataclasses.replace(pp4, global_batch_size=16)) == 2
    assert in_flight_micro_batches(dataclasses.replace(pp4, vpp=5)) == pytest.approx(4 * (1 + 3 / 20))

    no_pipeline = peak_memory(LLAMA3_70B, layout(num_nodes=8, tp=8, global_batch_size=64))
    first = stage_memory(LLAMA3_70B, pp4, first=True, last=False)
    last = stage_memory(LLAMA3_70B, pp4, first=False, last=True)
    per_layer = layer_activation_bytes(LLAMA3_70B, pp4)
    assert no_pipeline.activations == pytest.approx(LLAMA3_70B.num_layers * per_layer)
    assert first.activations == pytest.approx(4 * (LLAMA3_70B.num_layers // 4) * per_layer)
    assert last.activations == pytest.approx(LLAMA3_70B.num_layers // 4 * per_layer)
    assert first.logits == 0 and last.logits > 0  # the output layer and loss live on the last stage
    # Each stage holds a quarter of the layers; the first the embedding, the last the final norm and output.
    quarter = LLAMA3_70B.num_layers // 4 * layer_parameters(LLAMA3_70B, 8)
    embedding = LLAMA3_70B.vocab_size // 8 * LLAMA3_70B.hidden_size
    assert first.parameters == quarter + embedding
    assert last.parameters == quarter + embedding + LLAMA3_70B.hidden_size
    assert no_pipeline.parameters == 4 * quarter + 2 * embedding + LLAMA3_70B.hidden_size


def _gpt_with_dropout(**changes) -> ModelShape:
    return dataclasses.replace(GPT3_175B, hidden_dropout=0.1, attention_dropout=0.1, **changes)


def test_per_layer_activations_follow_korthikanti():
    """Korthikanti et al. (2022), bytes per layer in 16-bit with 1-byte dropout masks: sbh(10 + 24/t) with tensor
    parallelism, 34·sbh/t with sequence parallelism as well, 2·sbh(/t) with full recompute. A fused (flash)
    attention kernel keeps no s x s matrices (the 5·a·s²·b/t term), only its output's log-sum-exp (4·a·s·b/t)."""
    shape = _gpt_with_dropout()
    s, b, h, a = shape.seq_length, 1, shape.hidden_size, shape.num_attention_heads
    gpu = Kernels(flash=True, mask_as_activation=False)
    for t in (1, 2, 8):
        lse = 4 * a * s * b / t
        assert layer_activation_bytes(shape, layout(tp=t), gpu) == pytest.approx(s * b * h * (10 + 24 / t) + lse)
        # This runtime differs under SP in one place: the QKV and MLP-in matmuls keep their all-gathered input
        # (2·sbh each) where Megatron keeps the shard.
        sp = layout(tp=t, sequence_parallel=True)
        gathered = 2 * 2 * s * b * h * (1 - 1 / t)
        assert layer_activation_bytes(shape, sp, gpu) == pytest.approx(34 * s * b * h / t + gathered + lse)
        full = dataclasses.replace(sp, recompute="full")
        assert layer_activation_bytes(shape, full, gpu) == pytest.approx(2 * s * b * h / t)
    # Without a fused kernel the attention matrices come back: softmax output, dropout mask and output, plus the
    # scaled q and k the unfused path multiplies (2·sbh/t).
    unfused = Kernels(flash=False, mask_as_activation=False)
    for t in (1, 4):
        assert layer_activation_bytes(shape, layout(tp=t), unfused) == pytest.approx(
            s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t + 2 * 2 * s * b * h / t)


def test_recompute_and_sequence_parallelism_reduce_activations():
    base = layout(num_nodes=2, tp=8)
    none = layer_activation_bytes(LLAMA3_70B, base)
    sp = layer_activation_bytes(LLAMA3_70B, dataclasses.replace(base, sequence_parallel=True))
    selective = layer_activation_bytes(LLAMA3_70B, dataclasses.replace(
        base, sequence_parallel=True, recompute="selective", recompute_modules=("core_attention", "mlp")))
    full = layer_activation_bytes(LLAMA3_70B, dataclasses.replace(base, sequence_parallel=True, recompute="full"))
    assert none > sp > selective > full


def test_time_to_train_and_the_six_n_t_rule():
    shape = GPT3_175B
    tokens = 300e9
    # 1024 H100s at 40% MFU: FLOPs / (devices * peak * mfu), in days.
    expected = flops_per_token(shape) * tokens / (1024 * 989e12 * 0.4) / 86400
    assert days_to_train(shape, tokens, 1024, HARDWARE["h100"], 0.4) == pytest.approx(expected)
    assert six_n_t_parameters(6 * 175e9 * 300e9, 300e9) == pytest.approx(175e9)
    # The attention term makes the full count exceed 6N per token.
    assert flops_per_token(shape) > 6 * count_parameters(shape).non_embedding


def test_step_time_model_charges_bubbles_and_recompute():
    hw = HARDWARE["h100"]
    base = layout(num_nodes=16, tp=8, pp=4, global_batch_size=512)
    plain = step_time(GPT3_175B, base, hw, 0.4)
    interleaved = step_time(GPT3_175B, dataclasses.replace(base, vpp=3), hw, 0.4)
    recomputed = step_time(GPT3_175B, dataclasses.replace(base, recompute="full"), hw, 0.4)
    assert interleaved.bubble_s == pytest.approx(plain.bubble_s / 3)
    assert recomputed.compute_s > plain.compute_s and recomputed.total_s > plain.total_s


def test_recipe_estimate_uses_the_cluster_hardware():
    training = resolved("training=llama3/8b_trn2")["training"]
    assert estimate(training).hardware.name == "trn2"                       # 64 devices per node
    assert estimate(training, neuron_hardware="trn1").hardware.name == "trn1"
    assert estimate(training, device="h200").hardware.memory_bytes == 141e9
