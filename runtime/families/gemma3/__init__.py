# Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): config.json <-> our `model:` keys, the protocol of
# runtime/schema/families. The network (model.py): embeddings scaled by sqrt(hidden), Gemma's RMSNorm (x times
# 1 + weight, in fp32) before and after both attention and MLP, q/k norms per head, softmax scale
# query_pre_attn_scalar**-0.5, sliding-window layers (RoPE base rope_local_base_freq, unscaled) between full ones
# (rope_theta with its rope_scaling), GeGLU (gelu_pytorch_tanh), a tied head, head_dim of its own.
# Standard library only: the launcher imports it without torch.
from __future__ import annotations

import math
from typing import Any

from runtime.schema.architecture import Architecture

MODEL_TYPES = ("gemma3_text",)
# Model types of the family this folder does not import, each with the fix.
REFUSED_MODEL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration (image and text) is not supported; save its text "
                                 "model as Gemma3ForCausalLM (model_type gemma3_text) and give that directory"}
TIED_DEFAULT = True
# What the shared code asks of the network (runtime/schema/architecture.py): GeGLU, RMSNorms (fp32 copies), per-head
# q/k norms, four norms a layer (input, post-attention, pre- and post-feedforward), two RoPE tables (full and sliding
# layers'), and the ModelConfig keys it computes besides the common shape (rules.llama_switches reads them).
ARCHITECTURE = Architecture(
    "gemma3", network="runtime.families.gemma3.model:MODEL", weights="runtime.families.gemma3.weights",
    gated_mlp=True, rotary=True, biases=False, rms_norm=True, embedding_dropout=False, tied_default=True,
    switches=("rope_scaling", "sliding_window", "layer_types", "local_rotary_base", "softmax_scale"), qk_norm=True,
    norms_per_layer=4, rotary_tables=2)
LAYER_TYPES = ("sliding_attention", "full_attention")

# Gemma3TextConfig's defaults, which its loader applies to an absent key.
_GLOBAL_THETA, _LOCAL_THETA, _PATTERN = 1_000_000.0, 10_000.0, 6


def model_keys(hf) -> dict[str, Any]:
    """config.json (runtime/schema/families/base.HFConfig) -> our `model:` keys."""
    hf.require("hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    hf.require("attention_bias", (False,), False)
    hf.require("use_bidirectional_attention", (False, None), False)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):  # null in every Gemma 3
        hf.require(key, (None,), None)
    layers = hf.count("num_hidden_layers", 26)
    layer_types = hf.data.get("layer_types")
    if layer_types is None:  # the config class's pattern: every `sliding_window_pattern`-th layer full
        pattern = hf.count("sliding_window_pattern", _PATTERN)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != layers:
        raise ValueError(f"config.json layer_types={layer_types!r} must list {layers} (num_hidden_layers) of "
                         f"{' / '.join(LAYER_TYPES)}")
    full, local = _rope_by_layer_type(hf)
    keys = {"architecture": "gemma3", "hidden_size": hf.count("hidden_size", 2304), "num_layers": layers,
            "num_attention_heads": hf.count("num_attention_heads", 8),
            "num_query_groups": hf.count("num_key_value_heads", 4),
            "ffn_hidden_size": hf.count("intermediate_size", 9216), "kv_channels": hf.count("head_dim", 256),
            "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": hf.count("max_position_embeddings", 131_072),
            "softmax_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "layer_types": list(layer_types), **full}
    if "rope_scaling" in local:
        raise ValueError("config.json rope_parameters.sliding_attention scales RoPE: Gemma 3's sliding-window layers "
                         "use plain RoPE; supported: rope_type 'default'")
    keys["local_rotary_base"] = local["rotary_base"]
    if "sliding_attention" in layer_types:
        keys["sliding_window"] = hf.count("sliding_window", 4096)
    return keys


def _rope_by_layer_type(hf) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full_attention's, sliding_attention's) RoPE keys, from 4.x's rope_theta + rope_scaling +
    rope_local_base_freq or 5.x's rope_parameters by layer type (or flat: the full layers'). As transformers'
    Gemma3TextConfig reads them: rope_scaling updates the full layers' parameters."""
    params = hf.data.get("rope_parameters") or {}
    by_type = isinstance(params, dict) and set(params) <= set(LAYER_TYPES) and bool(params)
    full = dict(params.get("full_attention") or {}) if by_type else dict(params)
    full.update(hf.data.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {}) if by_type else {}
    reader = type(hf)
    full_keys = reader({"model_type": hf.model_type, "rope_theta": hf.data.get("rope_theta"),
                        "rope_parameters": full}).rope(_GLOBAL_THETA)
    local_keys = reader({"model_type": hf.model_type, "rope_theta": hf.data.get("rope_local_base_freq"),
                         "rope_parameters": local}).rope(_LOCAL_THETA)
    return full_keys, local_keys


def exports(cfg) -> bool:
    return cfg.architecture == "gemma3"


def refusal(cfg) -> str | None:
    return None


def _scalar(scale: float) -> float | int:
    """query_pre_attn_scalar from our softmax scale (its -1/2 power): an integer where it is one."""
    value = scale ** -2
    return round(value) if math.isclose(value, round(value), rel_tol=1e-12) else value


def hf_config(cfg) -> dict[str, Any]:
    scaling = cfg.rope_scaling
    rope = {"rope_theta": cfg.rotary_base, "rope_local_base_freq": cfg.local_rotary_base or cfg.rotary_base,
            "rope_scaling": None if scaling is None else {"rope_type": scaling.rope_type, "factor": scaling.factor}}
    if scaling is not None and scaling.rope_type == "llama3":
        rope["rope_scaling"].update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                                    original_max_position_embeddings=scaling.original_max_position_embeddings)
    layer_types = list(cfg.layer_types or ("full_attention",) * cfg.num_layers)
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
            "attention_bias": False, "attention_dropout": cfg.attention_dropout,
            "query_pre_attn_scalar": _scalar(cfg.softmax_scale or cfg.head_dim ** -0.5),
            "sliding_window": cfg.sliding_window or cfg.max_position_embeddings, "layer_types": layer_types,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, **rope}
