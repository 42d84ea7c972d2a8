"""MoE experts of a size of their own (model.moe.ffn_hidden_size, Qwen3-MoE's moe_intermediate_size) in the layers
model.moe.layers names: parameters, FLOPs and memory count each expert at its own size and every dense layer at
model.ffn_hidden_size. By hand for Qwen3-30B-A3B (the published 30.5B total, 3.3B active), from its config.json,
and against the runtime's own model (on the meta device), MFU formula and saved tensors at a tiny size."""

import dataclasses
import json

import pytest
import torch

from launcher.estimator import estimate
from launcher.estimator.compute import flops_per_token, matmul_weights, recompute_flops_per_token
from launcher.estimator.memory import backward_working_bytes, moe_activation_bytes, peak_memory, stage_memory
from launcher.estimator.shapes import (Layout, ModelShape, count_parameters, layer_parameters, padded_vocab,
                                       stage_parameters)
from runtime.metrics import model_flops_per_token
from runtime.models import meta_model
from runtime.models.moe import SparseMoE
from runtime.schema.model import ModelConfig, MoEConfig
from tests.launcher.helpers import resolved

# Qwen3-30B-A3B (Hugging Face Qwen/Qwen3-30B-A3B config.json): 48 layers, every one sparse, of 128 experts of 768
# hidden units where the dense intermediate_size is 6144; 32 heads of 128 over a hidden size of 2048, 4 KV heads,
# q/k norms, untied output.
QWEN3_30B_A3B = ModelShape("llama", 48, 2048, 6144, 32, 4, padded_vocab(151936, 128), 4096, 40960, False,
                           kv_channels=128, qk_layernorm=True,
                           moe=MoEConfig(num_experts=128, top_k=8, ffn_hidden_size=768))
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
    "hidden_act": "silu", "torch_dtype": "bfloat16"}

# A 2-layer llama whose second layer is MoE (moe.layers), with experts of 24 hidden units against a dense 64.
TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4,
                   ffn_hidden_size=64, max_position_embeddings=64, num_query_groups=2,
                   moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=24, layers=(1,)))
TINY_SHAPE = ModelShape("llama", 2, 32, 64, 4, 2, 256, 64, 64, False, moe=TINY.moe)


def layout(**changes) -> Layout:
    base = Layout(num_nodes=1, devices_per_node=8, tp=1, pp=1, vpp=1, micro_batch_size=1, global_batch_size=64,
                  sequence_parallel=False, zero1=False, recompute=None, recompute_modules=(),
                  precision="mixed_precision")
    return dataclasses.replace(base, **changes)


def test_qwen3_30b_a3b_total_and_active_parameters_by_hand():
    h, L, V, d, E, k, f = 2048, 48, 151936, 128, 128, 8, 768
    attention = h * (32 * d + 2 * 4 * d) + 32 * d * h + 2 * d  # q, k, v; o; q/k norms
    expert = 3 * h * f                                 # gate, up, down of 768 hidden units (not 6144)
    router, norms = E * h, 2 * h
    rest = 2 * V * h + h                               # untied embedding and output, final RMSNorm
    total = L * (attention + E * expert + router + norms) + rest
    active = L * (attention + k * expert + router + norms) + rest
    assert total == 30_532_122_624 and active == 3_353_032_704
    params = count_parameters(QWEN3_30B_A3B)
    assert params.total == total and params.active == active
    assert round(total / 1e9, 1) == 30.5 and active // 10**8 == 33  # published: 30.5B, 3.3B activated
    # Tensor and expert parallelism split the experts at their own size: 128 / 8 experts, a quarter of 768 each.
    memory = peak_memory(QWEN3_30B_A3B, layout(num_nodes=8, tp=4, ep=8))
    assert memory.expert_parameters == L * (E // 8) * 3 * h * (f // 4)


def test_qwen3_30b_a3b_flops_by_hand():
    h, L, V, d, E, k, f, s = 2048, 48, 151936, 128, 128, 8, 768, 4096
    q, kv = 32 * d, 4 * d
    weights = L * (h * (q + 2 * kv) + q * h + k * 3 * h * f + E * h) + h * V  # norms multiply nothing
    assert matmul_weights(QWEN3_30B_A3B) == weights
    assert flops_per_token(QWEN3_30B_A3B) == 6.0 * weights + 12.0 * L * q * s
    selective = layout(recompute="selective", recompute_modules=("mlp",))
    assert recompute_flops_per_token(QWEN3_30B_A3B, selective) == 2.0 * L * (k * 3 * h * f + E * h)


def test_qwen3_30b_a3b_moe_activations_by_hand():
    h, f, k, E, s = 2048, 768, 8, 128, 4096
    lay = layout(tp=2)
    # Dropless: one row per assignment with its token copy and the SwiGLU intermediates (4f / tp, bf16), the
    # gathered and weighted outputs and bookkeeping per assignment, the router's fp32 probabilities per token.
    assert moe_activation_bytes(QWEN3_30B_A3B, lay) == s * k * 2 * (h + 4 * f // 2) + s * k * (2 * 2 * h + 49) \
        + s * (4 * E + 4)
    assert backward_working_bytes(QWEN3_30B_A3B, lay, moe=True) == 2 * s * (h + 2 * k * f // 2)


def test_qwen3_30b_a3b_from_its_config_json(tmp_path):
    """The estimate of a run whose model_config is Qwen3-30B-A3B's config.json: the Qwen3-MoE import's expert size
    (moe_intermediate_size) and its sparse layers (mlp_only_layers) reach the parameter count."""
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}}))
    training = resolved("training=mixtral/tiny")["training"]
    model = training["model"]
    for key in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "layernorm_epsilon", "rotary_base", "moe", "max_position_embeddings"):  # config.json decides them
        model.pop(key, None)
    model["tokenizer"] = {"model": str(tmp_path / "tokenizer.json")}
    model["model_config"] = str(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    result = estimate(training)
    assert result.shape.expert_ffn_hidden_size == 768 and result.shape.ffn_hidden_size == 6144
    assert result.parameters.total == count_parameters(QWEN3_30B_A3B).total == 30_532_122_624
    # Two dense layers (Qwen3-MoE's mlp_only_layers): the experts of those layers give way to a 6144-wide MLP.
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B_CONFIG, "mlp_only_layers": [0, 47]}))
    result = estimate(training)
    assert result.shape.num_moe_layers == 46 and result.shape.moe.layers == tuple(range(1, 47))
    h = 2048
    assert result.parameters.total == 30_532_122_624 + 2 * (3 * h * 6144 - 128 * 3 * h * 768 - 128 * h)
    assert result.parameters.active == 3_353_032_704 + 2 * (3 * h * 6144 - 8 * 3 * h * 768 - 128 * h)


def test_tiny_parameters_match_the_runtime_model():
    """The runtime's model on the meta device (shapes, no memory): the dense layer's SwiGLU at 64, the MoE layer's
    experts (E, h, 2 x 24) and (E, 24, h), each pipeline stage's share."""
    model = meta_model(TINY)

    def params(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    assert model.layers[1].mlp.down.shape == (4, 24, 32)
    assert count_parameters(TINY_SHAPE).total == model.num_params()
    assert layer_parameters(TINY_SHAPE) == params(model.layers[0])
    assert layer_parameters(TINY_SHAPE, moe=True) == params(model.layers[1])
    # pp 2: the dense layer 0 with the embedding first, the MoE layer 1 with the final norm and output last.
    pp2 = layout(pp=2)
    assert stage_parameters(TINY_SHAPE, pp2, first=True, last=False) == params(model.embed) + params(model.layers[0])
    assert stage_parameters(TINY_SHAPE, pp2, first=False, last=True) == (
        params(model.layers[1]) + params(model.final_norm) + params(model.output))
    assert stage_memory(TINY_SHAPE, pp2, first=True, last=False).expert_parameters == 0
    assert stage_memory(TINY_SHAPE, pp2, first=False, last=True).expert_parameters == 4 * 3 * 32 * 24


def test_tiny_flops_by_hand_and_from_the_runtime_model():
    h, q, kv, f, f_expert, E, k, V, s = 32, 32, 16, 64, 24, 4, 2, 256, 64
    attention = h * (q + 2 * kv) + q * h
    weights = 2 * attention + 3 * h * f + (k * 3 * h * f_expert + E * h) + h * V
    assert weights == 25_216
    assert flops_per_token(TINY_SHAPE) == model_flops_per_token(TINY, s) == 6.0 * weights + 12.0 * 2 * q * s
    # The same N read off the runtime's model: every linear weight but the embedding, of the experts top_k of E.
    model = meta_model(TINY)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = model.layers[1].mlp.gate_up.numel() + model.layers[1].mlp.down.numel()
    assert linears + experts * k // E == weights


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward from one forward of `module`, less the
    parameters and the input (counted elsewhere: weights, and the block's input in layer_activation_bytes)."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(storages.values())


@pytest.mark.parametrize("capacity_factor", [1.0, 2.0])
def test_moe_activations_follow_the_expert_size_as_autograd_keeps_them(capacity_factor):
    """What the MoE block keeps grows with each expert's hidden units, not the dense MLP's: the estimate's change
    from experts of 64 (the dense size) to 24 is the measured one. A capacity fixes the batches' rows whatever
    the routing, so the counts are exact."""
    b, h, s = 2, 32, 16
    measured, estimated = [], []
    for expert_ffn in (None, 24):
        moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity_factor, ffn_hidden_size=expert_ffn)
        torch.manual_seed(0)
        block = SparseMoE(h, expert_ffn or 64, 4, 2, capacity_factor=capacity_factor)
        measured.append(_saved_bytes(block, torch.randn(b, s, h, requires_grad=True)))
        shape = ModelShape("llama", 2, h, 64, 4, 2, 256, s, s, False, moe=moe)
        estimated.append(moe_activation_bytes(shape, layout(micro_batch_size=b, precision="fp32")))
    assert measured[0] - measured[1] == estimated[0] - estimated[1] > 0
