"""Qwen-style attention in the estimator: a head size set apart from hidden / heads (model.kv_channels), biases on
q, k and v (add_qkv_bias), per-head q/k norms (qk_layernorm), and the RoPE tables that one module holds for every
layer. Parameters and FLOPs by hand and against the runtime's own model and MFU formula; the norms' activations
against what autograd keeps."""

import dataclasses

import pytest
import torch

from launcher.estimator import estimate
from launcher.estimator.compute import flops_per_token, matmul_weights
from launcher.estimator.memory import layer_activation_bytes, stage_memory
from launcher.estimator.shapes import Layout, ModelShape, count_parameters, layer_parameters
from runtime.metrics import model_flops_per_token
from runtime.models import ModelConfig, build_model, meta_model
from tests.launcher.helpers import resolved

# Qwen3-32B (Hugging Face Qwen/Qwen3-32B config.json): 64 heads of 128 over a hidden size of 5120 (not 5120 / 64),
# 8 KV heads, q/k norms, untied output; a 4096-token run of its 40960 positions.
QWEN3_32B = ModelShape("llama", 64, 5120, 25600, 64, 8, 151936, 4096, 40960, False, kv_channels=128,
                       qk_layernorm=True)


def layout(**changes) -> Layout:
    base = Layout(num_nodes=1, devices_per_node=8, tp=1, pp=1, vpp=1, micro_batch_size=1, global_batch_size=64,
                  sequence_parallel=False, zero1=False, recompute=None, recompute_modules=(),
                  precision="mixed_precision")
    return dataclasses.replace(base, **changes)


def test_qwen3_32b_parameters_by_hand():
    h, L, V, f, d = 5120, 64, 151936, 25600, 128
    q, kv = 64 * d, 8 * d                              # 8192 query rows: wider than the hidden size
    per_layer = h * q + 2 * h * kv + q * h + 2 * d + 2 * h + 3 * h * f  # q; k, v; o; q/k norms; two RMSNorms; MLP
    expected = L * per_layer + 2 * V * h + h          # untied embedding and output, final RMSNorm
    assert count_parameters(QWEN3_32B).total == expected == 32_762_123_264  # the published 32.8B
    # Tensor parallelism splits the heads (and q/k/v biases) but each rank keeps both q/k norms whole.
    assert layer_parameters(QWEN3_32B, 8) == h * q // 8 + 2 * h * kv // 8 + q // 8 * h + 2 * d + 2 * h + 3 * h * f // 8
    qwen2 = dataclasses.replace(QWEN3_32B, qk_layernorm=False, add_qkv_bias=True)
    assert layer_parameters(qwen2, 8) - layer_parameters(QWEN3_32B, 8) == (q + 2 * kv) // 8 - 2 * d


def test_flops_per_token_with_the_head_size_by_hand():
    h, L, V, f, s, q, kv = 5120, 64, 151936, 25600, 4096, 64 * 128, 8 * 128
    weights = L * (h * (q + 2 * kv) + q * h + 3 * h * f) + h * V  # norms and biases multiply nothing
    assert matmul_weights(QWEN3_32B) == weights
    assert flops_per_token(QWEN3_32B) == 6.0 * weights + 12.0 * L * q * s  # QK^T and AV are q wide, not h
    # Without a head size the formula is the one it always was.
    default = dataclasses.replace(QWEN3_32B, kv_channels=None)
    assert flops_per_token(default) == flops_per_token(dataclasses.replace(default, kv_channels=h // 64))
    assert flops_per_token(default) == 6.0 * matmul_weights(default) + 12.0 * L * h * s


TINY = dict(architecture="llama", vocab_size=512, hidden_size=96, num_layers=4, num_attention_heads=6,
            ffn_hidden_size=160, max_position_embeddings=128, num_query_groups=2)


@pytest.mark.parametrize("switches", [dict(kv_channels=24), dict(kv_channels=24, qk_layernorm=True),
                                      dict(kv_channels=8, add_qkv_bias=True), dict(add_qkv_bias=True)])
def test_parameters_and_flops_match_the_runtime(switches):
    """The runtime's own model (built on the meta device: shapes, no memory) and its MFU formula."""
    cfg = ModelConfig(**TINY, **switches)
    shape = ModelShape("llama", cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
                       cfg.kv_heads, cfg.vocab_size, 64, cfg.max_position_embeddings, False, **switches)
    assert shape.head_dim == cfg.head_dim
    assert count_parameters(shape).total == meta_model(cfg).num_params()
    assert flops_per_token(shape) == model_flops_per_token(cfg, 64)


def test_estimate_reads_the_switches_from_the_training_config():
    training = resolved("training=llama/tiny")["training"]
    model = training["model"]
    model.update(kv_channels=64, add_qkv_bias=True, qk_layernorm=True)
    result = estimate(training, vocab_size=4096)
    shape = result.shape
    assert (shape.head_dim, shape.add_qkv_bias, shape.qk_layernorm) == (64, True, True)
    cfg = ModelConfig(architecture="llama", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      num_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                      ffn_hidden_size=shape.ffn_hidden_size, max_position_embeddings=shape.max_position_embeddings,
                      num_query_groups=shape.num_query_groups, kv_channels=64, add_qkv_bias=True, qk_layernorm=True)
    assert result.parameters.total == meta_model(cfg).num_params()
    assert result.flops_per_token == model_flops_per_token(cfg, shape.seq_length)


def test_rope_tables_are_one_pair_per_device():
    """runtime/families/llama/model.py shares one RotaryEmbedding among all layers: a device holds one fp32 cos and one
    sin table of max_position_embeddings x head_dim, however many layers it has."""
    tables = 40960 * 128 * 2 * 4
    assert stage_memory(QWEN3_32B, layout(), first=True, last=True).buffers == tables
    pipeline = layout(num_nodes=8, pp=4)
    assert stage_memory(QWEN3_32B, pipeline, first=True, last=False).buffers == tables
    model = meta_model(ModelConfig(**TINY, kv_channels=24))
    buffers = {id(b): b.numel() * 4 for b in model.buffers()}  # fp32 once materialized
    assert sum(buffers.values()) == stage_memory(
        dataclasses.replace(QWEN3_32B, num_layers=4, hidden_size=96, num_attention_heads=6, kv_channels=24,
                            max_position_embeddings=128), layout(), first=True, last=True).buffers


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward from one forward of `module`."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(storages.values())


@pytest.mark.parametrize("precision,dtype", [("mixed_precision", torch.bfloat16), ("fp32", torch.float32)])
@pytest.mark.parametrize("groups", [2, 6])  # GQA (k, v repeated for core attention) and plain multi-head
def test_qk_norm_activations_are_what_autograd_keeps(precision, dtype, groups):
    """What the q/k norms add to a layer's activations, estimated and as the runtime's attention keeps it. The
    measured difference also holds the norms' two weights (or, in bf16, their fp32 copies): 2 x head_dim x 4 bytes,
    which the estimate counts with the weights instead."""
    b, s, d = 2, 16, 24
    measured, estimated = [], []
    for norm in (False, True):
        cfg = ModelConfig(**{**TINY, "num_query_groups": groups, "max_position_embeddings": s}, kv_channels=d,
                          qk_layernorm=norm)
        attention = build_model(cfg).layers[0].attn.to(dtype)
        measured.append(_saved_bytes(attention, torch.randn(b, s, cfg.hidden_size, dtype=dtype, requires_grad=True)))
        shape = ModelShape("llama", cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
                           groups, cfg.vocab_size, s, s, False, kv_channels=d, qk_layernorm=norm)
        estimated.append(layer_activation_bytes(shape, layout(micro_batch_size=b, precision=precision)))
    assert measured[1] - measured[0] - 2 * d * 4 == estimated[1] - estimated[0]
