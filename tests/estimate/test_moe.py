"""The estimator on MoE models: total and active parameters by hand (Mixtral 8x7B's published 46.7B / 12.9B),
against the runtime's model and MFU formula, memory that holds every expert but activates top_k, expert and
tensor parallelism dividing the experts (by hand for Mixtral 8x7B at TP 8 x EP 4), the all-to-all in the step
time, and the CLI."""

import dataclasses

import pytest

from launcher.estimator import estimate
from launcher.estimator.compute import all_to_all_bytes, flops_per_token, recompute_flops_per_token, step_time
from launcher.estimator.hardware import HARDWARE
from launcher.estimator.memory import layer_activation_bytes, moe_activation_bytes, peak_memory, stage_memory
from launcher.estimator.shapes import Layout, ModelShape, count_parameters, layer_parameters, padded_vocab
from runtime.schema.model import MoEConfig
from tests.launcher.helpers import nxdt, resolved

MIXTRAL_8X7B = ModelShape("llama", 32, 4096, 14336, 32, 8, padded_vocab(32000, 128), 4096, 32768, False,
                          moe=MoEConfig(num_experts=8, top_k=2))
DENSE_7B = dataclasses.replace(MIXTRAL_8X7B, moe=None)  # Mistral 7B's shape: the same layers with one MLP


def layout(**changes) -> Layout:
    base = Layout(num_nodes=8, devices_per_node=8, tp=1, pp=1, vpp=1, micro_batch_size=1, global_batch_size=64,
                  sequence_parallel=False, zero1=False, recompute=None, recompute_modules=(),
                  precision="mixed_precision")
    return dataclasses.replace(base, **changes)


def test_mixtral_8x7b_total_and_active_parameters_by_hand():
    h, L, V, f, kv, E = 4096, 32, 32000, 14336, 8 * 128, 8
    attention = h * (h + 2 * kv) + h * h          # q, k, v; o   = 41,943,040
    expert = 3 * h * f                            # gate, up, down = 176,160,768
    router = E * h                                # 32,768
    norms = 2 * h
    rest = 2 * V * h + h                          # untied embedding and output, final RMSNorm
    total = L * (attention + E * expert + router + norms) + rest
    active = L * (attention + 2 * expert + router + norms) + rest
    assert total == 46_702_792_704 and active == 12_879_925_248
    params = count_parameters(MIXTRAL_8X7B)
    assert params.total == total and params.active == active
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9
    # Dense: active is the total, and nothing else changed.
    assert count_parameters(DENSE_7B).active == count_parameters(DENSE_7B).total == L * (attention + expert + norms) + rest


def test_frequency_makes_every_other_layer_moe():
    shape = dataclasses.replace(MIXTRAL_8X7B, moe=MoEConfig(num_experts=8, top_k=2, frequency=2))
    assert shape.num_moe_layers == 16  # layers 0, 2, ..., 30
    moe, dense = layer_parameters(shape, moe=True), layer_parameters(shape)
    assert count_parameters(shape).layers == 16 * moe + 16 * dense
    assert count_parameters(shape).idle_experts == 16 * 6 * 3 * 4096 * 14336


def test_flops_count_the_active_experts_and_the_router():
    h, f, E, k, L = 4096, 14336, 8, 2, 32
    extra_per_layer = 6 * ((k - 1) * 3 * h * f + E * h)  # a second expert and the router, forward + backward
    assert flops_per_token(MIXTRAL_8X7B) == flops_per_token(DENSE_7B) + L * extra_per_layer
    # 6·N over the active matmul weights (embedding lookup and norms left out) plus the attention term.
    params = count_parameters(MIXTRAL_8X7B)
    matmul = params.active - params.embedding - L * 2 * h - h
    assert flops_per_token(MIXTRAL_8X7B) == 6 * matmul + 12 * L * h * 4096
    selective = layout(recompute="selective", recompute_modules=("mlp",))
    assert recompute_flops_per_token(MIXTRAL_8X7B, selective) == 2 * L * (k * 3 * h * f + E * h)


def test_mixtral_tiny_matches_the_runtime_model_and_mfu_formula():
    from runtime.metrics import model_flops_per_token
    from runtime.models import ModelConfig, build_model

    result = estimate(resolved("training=mixtral/tiny")["training"], vocab_size=4096)
    shape = result.shape
    assert shape.moe == MoEConfig(num_experts=4, top_k=2, frequency=1, capacity_factor=None,
                                  router_aux_loss_coef=0.02)
    model = build_model(ModelConfig(architecture="llama", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                                    num_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                                    ffn_hidden_size=shape.ffn_hidden_size,
                                    max_position_embeddings=shape.max_position_embeddings,
                                    num_query_groups=shape.num_query_groups, moe=shape.moe))
    assert result.parameters.total == model.num_params()
    assert result.parameters.active < result.parameters.total
    assert result.flops_per_token == model_flops_per_token(model.cfg, shape.seq_length)


def test_num_experts_zero_or_null_moe_is_dense():
    base = resolved("training=llama/tiny")["training"]
    dense = estimate(base, vocab_size=4096)
    for moe in (None, {"num_experts": 0, "top_k": 2}):
        training = {**base, "model": {**base["model"], "moe": moe}}
        assert estimate(training, vocab_size=4096) == dense


def test_memory_holds_every_expert_and_activates_top_k():
    lay = layout()
    moe, dense = peak_memory(MIXTRAL_8X7B, lay), peak_memory(DENSE_7B, lay)
    assert moe.parameters == count_parameters(MIXTRAL_8X7B).total
    assert moe.weights == moe.parameters * 2 and moe.gradients == moe.parameters * 4
    assert moe.optimizer == moe.parameters * 12                    # replicated on each of the 64 dp ranks
    # Activations: the attention part as dense, the MLP part top_k experts' worth (3h + 4f per assignment in
    # bf16, against the dense MLP's 4f per token) plus the router and the routing bookkeeping.
    s, h, f = 4096, 4096, 14336
    per_layer = layer_activation_bytes(MIXTRAL_8X7B, lay, moe=True) - layer_activation_bytes(DENSE_7B, lay)
    assert per_layer == moe_activation_bytes(MIXTRAL_8X7B, lay) - 2 * s * 4 * f
    assert moe_activation_bytes(MIXTRAL_8X7B, lay) == s * 2 * (2 * (3 * h + 4 * f) + 49) + s * (4 * 8 + 4)
    assert moe.activations == pytest.approx(dense.activations + 32 * per_layer)
    # The expert weights' share of the static memory dwarfs the activations they add.
    assert moe.static - dense.static > 10 * (moe.activations - dense.activations)


def test_pipeline_stages_count_their_own_moe_layers():
    shape = dataclasses.replace(MIXTRAL_8X7B, moe=MoEConfig(num_experts=8, top_k=2, frequency=4))  # 0, 4, ..., 28
    pp4 = layout(pp=4, num_nodes=4)                    # 8 layers per stage: 2 MoE layers on every stage
    first = stage_memory(shape, pp4, first=True, last=False)
    dense_first = stage_memory(DENSE_7B, pp4, first=True, last=False)
    extra = layer_parameters(shape, moe=True) - layer_parameters(shape)
    assert first.parameters == dense_first.parameters + 2 * extra
    # Interleaved (vpp 2, 4-layer chunks): rank 0 holds layers 0-3 and 16-19, MoE layers 0 and 16; the last rank
    # 12-15 and 28-31: 12 and 28.
    vpp = dataclasses.replace(pp4, vpp=2)
    assert stage_memory(shape, vpp, first=True, last=False).parameters == dense_first.parameters + 2 * extra
    frequency_3 = dataclasses.replace(shape, moe=MoEConfig(num_experts=8, top_k=2, frequency=3))
    # frequency 3: MoE layers 0, 3, ..., 30; rank 0 holds 0-3 and 16-19 (0, 3, 18), the last rank 12-15 and
    # 28-31 (12, 15, 30).
    last = stage_memory(frequency_3, vpp, first=False, last=True)
    dense_last = stage_memory(DENSE_7B, vpp, first=False, last=True)
    assert last.parameters == dense_last.parameters + 3 * extra


def trn1_tp8(**changes) -> Layout:
    """4 trn1 nodes (128 NeuronCores), TP 8 with sequence parallelism, ZeRO-1: DP 16, 8 micro-batches a step."""
    base = dict(num_nodes=4, devices_per_node=32, tp=8, sequence_parallel=True, zero1=True, global_batch_size=128)
    return layout(**{**base, **changes})


def test_mixtral_8x7b_memory_per_device_at_tp8_ep4_by_hand():
    h, f, V, L, d = 4096, 14336, 32000, 32, 128
    attention = h * (32 // 8 * d + 2 * (8 // 8) * d) + (32 // 8 * d) * h   # q, k, v, o of 4 of 32 heads, 1 KV head
    expert = 3 * h * (f // 8)                        # gate, up (columns) and down (rows): an eighth of each expert
    experts = 8 // 4 * expert                        # EP 4: 2 of the 8 experts
    router, norms = 8 * h, 2 * h                     # replicated over TP and EP
    assert expert == 22_020_096 and experts == 44_040_192
    per_device = L * (attention + experts + router + norms) + 2 * (V // 8) * h + h
    expert_part = L * experts
    assert per_device == 1_611_141_120 and expert_part == 1_409_286_144

    memory = peak_memory(MIXTRAL_8X7B, trn1_tp8(ep=4))
    assert memory.parameters == per_device and memory.expert_parameters == expert_part
    assert memory.weights == 2 * per_device and memory.gradients == 4 * per_device
    # ZeRO-1: the dense state over all 16 DP ranks, the experts' over the 16 / 4 = 4 ranks holding the same experts.
    assert memory.optimizer == pytest.approx(12 * ((per_device - expert_part) / 16 + expert_part / 4))
    # Activations: each assignment keeps three rows of h (its copy for the experts, the expert's output and the
    # weighted output) and an eighth of the SwiGLU intermediates (4f / 8).
    s = 4096
    assert moe_activation_bytes(MIXTRAL_8X7B, trn1_tp8(ep=4)) == s * 2 * (2 * (3 * h + 4 * f // 8) + 49) + s * 36
    assert layer_activation_bytes(MIXTRAL_8X7B, trn1_tp8(ep=4), moe=True) == \
        layer_activation_bytes(MIXTRAL_8X7B, trn1_tp8(ep=1), moe=True)  # expert parallelism moves, not adds


def test_memory_falls_as_ep_grows():
    memories = {ep: peak_memory(MIXTRAL_8X7B, trn1_tp8(ep=ep)) for ep in (1, 2, 4, 8)}
    totals = [memories[ep].total for ep in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    one, four = memories[1], memories[4]
    assert one.expert_parameters == 4 * four.expert_parameters  # 8 experts per device, then 2
    assert one.parameters - one.expert_parameters == four.parameters - four.expert_parameters
    # ZeRO-1 already spread every expert's optimizer state over all 16 DP ranks; EP hands each rank the state of
    # its own experts instead, the same amount. Without ZeRO-1 the state falls with the experts.
    assert four.optimizer == pytest.approx(one.optimizer)
    plain = {ep: peak_memory(MIXTRAL_8X7B, trn1_tp8(ep=ep, zero1=False)) for ep in (1, 4)}
    assert plain[1].optimizer - plain[4].optimizer == 12 * (one.expert_parameters - four.expert_parameters)
    assert round(one.total / 2**30, 1) == 49.9 and round(four.total / 2**30, 1) == 26.3


def test_all_to_all_appears_only_with_expert_parallelism():
    trn1 = HARDWARE["trn1"]
    assert step_time(MIXTRAL_8X7B, trn1_tp8(ep=1), trn1, 0.4).expert_parallel_s == 0
    assert step_time(DENSE_7B, trn1_tp8(ep=4), trn1, 0.4).expert_parallel_s == 0
    # Per MoE layer and micro-batch each rank exchanges every (token, slot) row: top_k x seq x hidden bf16 values,
    # of which (ep - 1) / ep leave it; twice forward (dispatch, combine) and twice backward.
    sent = 2 * 4096 * 4096 * 2
    assert all_to_all_bytes(MIXTRAL_8X7B, trn1_tp8(ep=4)) == sent == 67_108_864
    # EP 4 x TP 8 = 32 consecutive ranks: one trn1 node, at the 100 GB/s the TP collectives use. 8 micro-batches
    # (128 / 16 DP ranks) x 32 layers x 4 exchanges.
    ep4 = step_time(MIXTRAL_8X7B, trn1_tp8(ep=4), trn1, 0.4)
    assert ep4.expert_parallel_s == pytest.approx(8 * 32 * 4 * sent * 3 / 4 / 100e9) == pytest.approx(0.5154, rel=1e-4)
    assert ep4.total_s == pytest.approx(ep4.compute_s + ep4.bubble_s + ep4.tensor_parallel_s + ep4.data_parallel_s
                                        + ep4.pipeline_s + ep4.expert_parallel_s)
    # Full recompute reruns each block's forward: two more exchanges per layer.
    full = step_time(MIXTRAL_8X7B, trn1_tp8(ep=4, recompute="full"), trn1, 0.4)
    assert full.expert_parallel_s == pytest.approx(ep4.expert_parallel_s * 6 / 4)
    # EP 8 x TP 8 spans two nodes: the network's 100 / 32 GB/s per NeuronCore.
    ep8 = step_time(MIXTRAL_8X7B, trn1_tp8(ep=8), trn1, 0.4)
    assert ep8.expert_parallel_s == pytest.approx(8 * 32 * 4 * sent * 7 / 8 / (100e9 / 32))
    # Expert gradients are reduced over the 16 / ep ranks holding the same experts: less traffic as ep grows.
    one = step_time(MIXTRAL_8X7B, trn1_tp8(ep=1), trn1, 0.4)
    assert one.data_parallel_s > ep4.data_parallel_s > ep8.data_parallel_s


def test_recipe_reads_expert_model_parallel_size():
    training = resolved("training=mixtral/8x7b_trn2")["training"]
    result = estimate(training)
    assert (result.layout.tp, result.layout.dp, result.layout.ep, result.layout.edp) == (16, 4, 4, 1)
    assert result.memory.expert_parameters > 0 and result.step.expert_parallel_s > 0
    one = estimate({**training, "model": {**training["model"], "expert_model_parallel_size": 1}})
    assert one.memory.total > result.memory.total and one.step.expert_parallel_s == 0


def test_estimate_command_shows_total_and_active_parameters():
    result = nxdt("estimate", "training=mixtral/tiny", "--vocab-size", "4096")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mixtral/tiny: 2.33 M parameters (1.79 M active: top-2 of 4 experts in 4 of 4 layers)" in out
    assert "weights (fp32, all 4 experts)" in out and "6·N active" in out
    dense = nxdt("estimate", "training=llama/tiny", "--vocab-size", "4096").stdout
    assert "llama/tiny: 1.79 M parameters on" in dense and "active" not in dense


def test_estimate_command_shows_the_expert_layout():
    result = nxdt("estimate", "training=mixtral/8x7b_gpu")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "tp 2 · pp 4 (virtual 8) · dp 8 · ep 4" in out
    assert "weights (bf16, 2 of 8 experts (ep 4))" in out
    assert "÷ dp 8, experts' ÷ 2 (ZeRO-1)" in out
    assert "+ ep all-to-all" in out


def test_a_capacity_fixes_the_expert_batches_whatever_the_routing():
    # With a capacity factor the runtime pads every expert's batch to ceil(cf x tokens x top_k / E) rows and
    # sends those fixed batches: memory and all-to-all scale with the factor, padding included.
    h, f, s = 4096, 14336 // 8, 4096
    capped = dataclasses.replace(MIXTRAL_8X7B, moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=2.0))
    lay = trn1_tp8(ep=4)
    rows = 8 * -(-2.0 * s * 2 // 8)  # 16384: twice the 8192 balanced assignments
    # Each of the 8 TP ranks carries 1/8 of every fixed batch's rows (dropless, each sends its own full copy).
    assert all_to_all_bytes(capped, lay) == rows / 8 * h * 2 == 2 * all_to_all_bytes(MIXTRAL_8X7B, lay) / 8
    extra = (rows - 2 * s) * 2 * (h + 4 * f)  # the padded rows' token copies and SwiGLU intermediates, bf16
    assert moe_activation_bytes(capped, lay) == moe_activation_bytes(MIXTRAL_8X7B, lay) + extra
    # A factor below 1 drops assignments: fewer rows than the balanced load.
    half = dataclasses.replace(MIXTRAL_8X7B, moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=0.5))
    assert all_to_all_bytes(half, trn1_tp8(ep=4, tp=1)) == all_to_all_bytes(MIXTRAL_8X7B, lay) / 2


def test_pipeline_cuts_give_each_stage_its_own_layers():
    """NxD Training's cuts for a 32-layer model on pp 4 (stages of 7, 9, 9 and 7 layers): the first and last
    stages hold their own layers' parameters and activations, and the step waits on the 9-layer stages."""
    from launcher.estimator.shapes import most_layers, rank_layers

    even, cut = layout(pp=4, tp=2, num_nodes=4), layout(pp=4, tp=2, num_nodes=4, pipeline_cuts=(6, 15, 24))
    assert [len(rank_layers(DENSE_7B, cut, r)) for r in range(4)] == [7, 9, 9, 7]
    assert most_layers(DENSE_7B, cut) == 9 and most_layers(DENSE_7B, even) == 8
    first_even = stage_memory(DENSE_7B, even, first=True, last=False)
    first_cut = stage_memory(DENSE_7B, cut, first=True, last=False)
    assert first_even.parameters - first_cut.parameters == layer_parameters(DENSE_7B, 2)  # 8 layers against 7
    hardware = HARDWARE["trn1"]
    assert step_time(DENSE_7B, cut, hardware, 0.3).compute_s == step_time(DENSE_7B, even, hardware, 0.3).compute_s
    # Tensor-parallel collectives per layer, on the stage with the most layers: 9 against 8.
    assert step_time(DENSE_7B, cut, hardware, 0.3).tensor_parallel_s == pytest.approx(
        step_time(DENSE_7B, even, hardware, 0.3).tensor_parallel_s * 9 / 8)


def test_a_middle_stage_that_cuts_make_the_largest_is_the_peak():
    """Cuts after layers 0, 28 and 29 of 32: stages of 1, 28, 1 and 2 layers. The peak is rank 1's, not the first's
    or the last's."""
    from launcher.estimator.memory import peak_memory

    cut = layout(pp=4, tp=2, num_nodes=4, pipeline_cuts=(0, 28, 29))
    peak = peak_memory(DENSE_7B, cut)
    assert peak.stage == "rank 1" and peak.parameters >= 28 * layer_parameters(DENSE_7B, 2)
    assert peak.total > max(stage_memory(DENSE_7B, cut, first=True, last=False).total,
                            stage_memory(DENSE_7B, cut, first=False, last=True).total)
