"""The folder families' own parts in runtime/schema/sizes.py, the one formula behind the estimate and the MFU:
DeepSeek-V3's latent attention, shared experts, selection bias and first dense layers; GPT-OSS's q/k/v/o biases,
attention sinks, router and expert biases and sliding-window layers; Gemma 3's sandwich norms, q/k norms and
sliding-window layers. Counted against the modules themselves (ours and transformers', built tiny), and against the
figures the publishers give for the real shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from launcher.estimator import compute, memory
from launcher.estimator.shapes import Layout, count_parameters, layer_parameters
from runtime import metrics
from runtime.models import build_model
from runtime.schema import sizes
from runtime.schema.model import LatentAttention, ModelConfig, MoEConfig, hf_model_keys
from runtime.schema.sizes import ModelShape

transformers = pytest.importorskip("transformers")

# Tiny configs with every part that sets a family apart non-trivial (vocabularies a multiple of 128: no padding).
DEEPSEEK_V3 = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
                   routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                   qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                   max_position_embeddings=256)
GPT_OSS = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=256, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
GEMMA3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=64,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=256)
# transformers' classes by name: reaching one loads its modeling module (and transformers' model stack, ~5 s), which
# collection on every worker would otherwise pay.
TINY = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3),
        "deepseek_v3_q_proj": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DEEPSEEK_V3, "q_lora_rank": None}),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3)}


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("name", list(TINY))
def test_the_count_is_the_built_models(name):
    """The estimate's total is sum(numel) of the model the runtime builds from the config.json, and of
    transformers' own model of it (plus DeepSeek's e_score_correction_bias, a buffer there and a parameter here:
    both are in the checkpoint). Every tensor-parallel rank's share adds up too, with what it holds whole."""
    config_name, model_name, values = TINY[name]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_class(**values)
    cfg = ModelConfig.from_model_section(hf_model_keys(config.to_dict()), tokenizer_vocab_size=128)
    with torch.device("meta"):
        ours, theirs = build_model(cfg), model_class(config)
    shape = ModelShape.of_model(cfg, 64)
    total = count_parameters(shape).total
    selection = sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias"))
    assert total == _numel(ours) == _numel(theirs) + selection, name
    # Each layer as built, at tp 1.
    for index, block in enumerate(ours.layers):
        assert layer_parameters(shape, moe=shape.is_moe_layer(index)) == _numel(block), (name, index)


def test_the_flops_count_what_a_token_multiplies_by():
    """6N: N is every matrix a token's forward multiplies by (its top_k experts of an MoE layer, the router, the
    shared experts; the output layer, not the embedding lookup), as the built DeepSeek-V3 holds them."""
    config = transformers.DeepseekV3Config(**DEEPSEEK_V3)
    cfg = ModelConfig.from_model_section(hf_model_keys(config.to_dict()), tokenizer_vocab_size=128)
    with torch.device("meta"):
        model = build_model(cfg)
    shape = ModelShape.of_model(cfg, 64)
    moe = cfg.moe
    matrices = sum(m.weight.numel() for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and ".experts" not in n)
    sparse = [m for m in model.modules() if hasattr(m, "gate_up") and isinstance(m.gate_up, torch.nn.Parameter)]
    per_expert = sparse[0].gate_up[0].numel() + sparse[0].down[0].numel()
    expected = matrices + len(sparse) * moe.top_k * per_expert
    assert sizes.matmul_weights(shape) == expected
    # Latent attention's core: QK^T over nope + rope channels, P.V over v_head_dim, every head, every key.
    latent = cfg.latent_attention
    width = cfg.num_attention_heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim + latent.v_head_dim)
    assert sizes.flops_per_token(shape) == 6 * expected + 6 * cfg.num_layers * 64 * width
    assert metrics.model_flops_per_token(cfg, 64) == compute.flops_per_token(shape) == sizes.flops_per_token(shape)


def test_a_sliding_window_layer_attends_to_its_window():
    """FLOPs: a window layer's core attention counts min(window, sequence) keys a query; the MFU and the estimate
    agree on it."""
    config = transformers.Gemma3TextConfig(**GEMMA3)
    cfg = ModelConfig.from_model_section(hf_model_keys(config.to_dict()), tokenizer_vocab_size=128)
    q = cfg.num_attention_heads * cfg.head_dim
    for seq, keys in ((32, 3 * 32), (256, 2 * 64 + 256)):  # shorter than the window: every layer sees all
        shape = ModelShape.of_model(cfg, seq)
        assert sizes.attention_flops_per_token(shape) == 4 * q * keys
        assert metrics.model_flops_per_token(cfg, seq) == compute.flops_per_token(shape)
    full = ModelShape.of_model(dataclasses.replace(cfg, layer_types=None, sliding_window=None), 256)
    assert sizes.flops_per_token(full) - sizes.flops_per_token(ModelShape.of_model(cfg, 256)) == \
        12 * q * 2 * (256 - 64)


def test_gpt_oss_sinks_are_spelled_out_and_counted():
    """GPT-OSS's core attention writes its scores out (CoreAttention._with_sinks: SDPA has no sink column), so its
    activations hold a (heads, s, s + 1) softmax per layer where a fused kernel keeps a log-sum-exp; the sinks,
    one per head, split over tensor parallelism with the heads."""
    config = transformers.GptOssConfig(**GPT_OSS)
    cfg = ModelConfig.from_model_section(hf_model_keys(config.to_dict()), tokenizer_vocab_size=128)
    shape = ModelShape.of_model(cfg, 256)
    layout = Layout(1, 2, 2, 1, 1, 1, 2, False, False, None, (), "bf16SR")
    heads = cfg.num_attention_heads // 2
    scores = memory.core_score_bytes(shape, layout, memory.Kernels(), heads)
    assert scores == heads * 256 * 257 * 2 + 256 * 256
    # Everything splits over the heads but the output projection's bias (hidden 32), whole on every rank.
    assert sizes.attention(shape, 2).parameters == (sizes.attention(shape, 1).parameters - 32) // 2 + 32


# The published shapes. DeepSeek-V3: deepseek-ai/DeepSeek-V3's config.json (the multi-token prediction layer, 14B
# of the checkpoint's 685B, is not part of the model here); the paper gives 671B total, 37B activated per token.
# gpt-oss: OpenAI's model card (table 1) gives 116.83B total / 5.13B active for 120b and 20.91B / 3.61B for 20b,
# counting active parameters without the embedding (its unembedding in). Gemma 3: Gemma3ForCausalLM of each
# config.json: 1B is 999,885,952 parameters (the text-only checkpoint as published); 4B, 12B and 27B are the text
# models of the image-and-text checkpoints, whose totals (4.30B, 12.19B, 27.43B) add the 417M SigLIP vision tower
# and the projector (exactly: test_gemma3_text_models_are_their_checkpoints_less_the_vision_tower).
def _deepseek_v3() -> ModelShape:
    moe = MoEConfig(num_experts=256, top_k=8, layers=tuple(range(3, 61)), ffn_hidden_size=2048, score_bias=True,
                    groups=8, top_groups=4, routed_scaling_factor=2.5, shared_ffn_hidden_size=2048,
                    router_activation="sigmoid")
    latent = LatentAttention(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             q_lora_rank=1536)
    return ModelShape("deepseek_v3", 61, 7168, 18432, 128, 128, 129280, 4096, 163840, False, moe=moe,
                      kv_channels=128, latent_attention=latent)


def _gpt_oss(layers: int, experts: int) -> ModelShape:
    return ModelShape("gpt_oss", layers, 2880, 2880, 64, 8, 201088, 4096, 131072, False,
                      moe=MoEConfig(num_experts=experts, top_k=4), kv_channels=64,
                      layer_types=("sliding_attention", "full_attention") * (layers // 2), sliding_window=128)


def _gemma3(layers, hidden, ffn, heads, groups, head_dim, vocab) -> ModelShape:
    return ModelShape("gemma3", layers, hidden, ffn, heads, groups, vocab, 4096, 131072, True, kv_channels=head_dim,
                      qk_layernorm=True)


# (shape, total, active, relative tolerance): the published figures are rounded to the digits they show, so the
# tolerance is half a unit of their last digit (671B: 0.5B, 37B: 0.5B, 116.83B: 0.005B, ...), relative to the figure.
PUBLISHED = {
    "deepseek_v3_671b": (_deepseek_v3(), 671e9, 37e9, 0.5 / 37),
    "gpt_oss_120b": (_gpt_oss(36, 128), 116.83e9, 5.13e9, 0.005 / 5.13),
    "gpt_oss_20b": (_gpt_oss(24, 32), 20.91e9, 3.61e9, 0.005 / 3.61),
    "gemma3_1b": (_gemma3(26, 1152, 6912, 4, 1, 256, 262144), 999_885_952, None, 0.0),
}
# The image-and-text checkpoints' totals (their model cards' safetensors counts) and the text model's hidden size:
# what is not the text model is the SigLIP tower (416,866,032, the same in all three) and the projector
# (1152 x hidden and its 1152-wide norm).
GEMMA3_MULTIMODAL = {"4b": (_gemma3(34, 2560, 10240, 8, 4, 256, 262208), 4_300_079_472),
                     "12b": (_gemma3(48, 3840, 15360, 16, 8, 256, 262208), 12_187_325_040),
                     "27b": (_gemma3(62, 5376, 21504, 32, 16, 128, 262208), 27_432_406_640)}
SIGLIP = 416_866_032
# The vision_config every Gemma 3 4B/12B/27B config.json carries: SigLIP so400m at 896 px, patch 14, no pooling head.
GEMMA3_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                 "image_size": 896, "patch_size": 14, "vision_use_head": False}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_real_shapes_count_their_published_parameters(name):
    shape, total, active, tolerance = PUBLISHED[name]
    count = count_parameters(shape)
    assert count.total == pytest.approx(total, rel=tolerance, abs=0), (name, count.total / 1e9)
    if active is not None:  # the publishers' convention: the embedding lookup is no active weight
        assert count.active - count.embedding == pytest.approx(active, rel=tolerance), (name, count.active / 1e9)


@pytest.mark.parametrize("size", list(GEMMA3_MULTIMODAL))
def test_gemma3_text_models_are_their_checkpoints_less_the_vision_tower(size):
    shape, published = GEMMA3_MULTIMODAL[size]
    assert count_parameters(shape).total + SIGLIP + 1152 * shape.hidden_size + 1152 == published


def test_the_vision_tower_is_transformers_siglip_of_gemma3s_vision_config():
    """SIGLIP above is no remembered figure: transformers' SiglipVisionModel built from that vision_config (on the meta
    device, no weights) holds exactly that many parameters."""
    import torch
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.device("meta"):
        tower = SiglipVisionModel(SiglipVisionConfig(**GEMMA3_VISION))
    assert sum(p.numel() for p in tower.parameters()) == SIGLIP


def test_latent_attention_splits_by_head_and_keeps_its_latents_whole():
    """Under tensor parallelism q_b, kv_b and proj split by head; q_a, kv_a and their norms stay whole on every rank
    (runtime/families/deepseek_v3/model.py LatentAttention.parallelize)."""
    shape = _deepseek_v3()
    latent = shape.latent_attention
    whole = 7168 * (latent.q_lora_rank + latent.kv_lora_rank + 64) + latent.q_lora_rank + latent.kv_lora_rank
    for tp in (1, 4, 8):
        split = 128 // tp * (latent.q_lora_rank * 192 + latent.kv_lora_rank * 256 + 128 * 7168)
        assert sizes.attention(shape, tp).parameters == whole + split
