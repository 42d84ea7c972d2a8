# GPT-OSS's config.json <-> our `model:` keys. The Llama decoder's shape keys (schema/families/decoder.py) with
# architecture gpt_oss, which fixes what every GPT-OSS has: biases on q, k, v and o, attention sinks, a sparse MoE
# block in every layer (router with a bias, softmax over the top-k logits, experts with biases and the clamped
# SwiGLU), YaRN RoPE; and HF's sliding_window / layer_types. Standard library only.
from __future__ import annotations

from typing import Any

from runtime.schema.architecture import Architecture

# runtime/schema/families (the registry) imports this module: its shared readers are imported where used.

# What the shared code asks of the network (runtime/schema/architecture.py): each expert's gate_up is 2 x ffn wide
# (gated), RMSNorms, one YaRN RoPE table, and the ModelConfig keys it computes beyond the common shape. Its q/k/v/o
# biases are its own (`biases` means GPT's: every linear and norm).
ARCHITECTURE = Architecture(
    "gpt_oss", network="runtime.families.gpt_oss.model:MODEL", weights="runtime.families.gpt_oss.weights",
    gated_mlp=True, rotary=True, biases=False, rms_norm=True, embedding_dropout=False, tied_default=False,
    switches=("rope_scaling", "sliding_window", "layer_types", "moe"), moe=True, attention_biases=True,
    attention_sinks=True, expert_biases=True)
MODEL_TYPES = ("gpt_oss",)
TIED_DEFAULT = False
# GptOssConfig's defaults where config.json leaves a key out.
_THETA, _EPS, _WINDOW = 150000.0, 1e-5, 128
# What the shared decoder reader would otherwise take as hidden / heads and as plain multi-head attention.
_DEFAULTS = {"head_dim": 64, "num_key_value_heads": 8}
_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}
# The clamped SwiGLU's constants, fixed in our experts (runtime/models/moe.py clamped_swiglu's defaults).
_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def model_keys(hf) -> dict[str, Any]:
    """config.json (a runtime.schema.families.base.HFConfig) -> our `model:` keys."""
    from runtime.schema.families.base import HFConfig
    from runtime.schema.families.decoder import decoder_keys, softmax_moe_keys

    hf.refuse_quantized("GPT-OSS", "transformers: from_pretrained with quantization_config=Mxfp4Config("
                                   "dequantize=True), then save_pretrained")
    hf.require("attention_bias", (True,), True)
    for key, value in _SWIGLU.items():
        hf.require(key, (value,), value)
    absent = {key: value for key, value in _DEFAULTS.items() if hf.data.get(key) is None}
    if hf.data.get("rope_scaling") is None and hf.data.get("rope_parameters") is None:
        absent["rope_parameters"] = _ROPE
    hf = HFConfig({**hf.data, **absent})
    keys = decoder_keys(hf, ARCHITECTURE.name, theta=_THETA, eps=_EPS)
    layers = keys["num_layers"]
    layer_types = hf.get("layer_types", None)
    if layer_types is None:  # GptOssConfig's: sliding first, then alternating
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    keys["layer_types"] = list(layer_types)
    if "sliding_attention" in layer_types:
        keys["sliding_window"] = hf.count("sliding_window", _WINDOW)
    keys["moe"] = softmax_moe_keys(hf, top_k=4)
    return keys


def exports(cfg) -> bool:
    return cfg.architecture == ARCHITECTURE.name


def refusal(cfg) -> str | None:
    moe = cfg.moe
    refusals = [
        (moe.layers is not None or moe.frequency != 1, "model.moe.layers / frequency: GptOssForCausalLM has a MoE "
                                                       "block in every layer; only frequency 1 can be exported"),
        (moe.capacity_factor is not None, f"model.moe.capacity_factor={moe.capacity_factor}: GptOssForCausalLM is "
                                          "dropless; export with model.moe.dropless=true to accept that difference"),
        (moe.ffn_hidden_size not in (None, cfg.ffn_hidden_size), f"model.moe.ffn_hidden_size={moe.ffn_hidden_size}: "
                                                                 "GPT-OSS's experts are model.ffn_hidden_size wide"),
    ]
    return next((message for refused, message in refusals if refused), None)


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.base import rope_export
    from runtime.schema.families.decoder import decoder_config

    shape = {k: v for k, v in decoder_config(cfg).items() if k not in ("rope_theta", "rope_scaling")}
    rope = rope_export(cfg)
    # 5.x's form, always: GptOssConfig reads a missing rope_parameters as YaRN, not as plain RoPE.
    rope_parameters = {"rope_theta": rope["rope_theta"], **(rope.get("rope_scaling") or {"rope_type": "default"})}
    layer_types = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
            "router_aux_loss_coef": cfg.moe.router_aux_loss_coef, "output_router_logits": False, **_SWIGLU,
            "layer_types": layer_types, "sliding_window": cfg.sliding_window, **shape,
            "rope_parameters": rope_parameters}
