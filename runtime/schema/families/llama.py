# Llama 2 / 3 / 3.1-3.3 (LlamaForCausalLM) and Mistral (MistralForCausalLM: the same layers and weight names,
# accepted without a sliding window). Llama 3.1+ scales RoPE (rope_type llama3); Llama 3.2 1B/3B tie the head.
from __future__ import annotations

from typing import Any

from runtime.schema.families.base import HFConfig
from runtime.schema.families.decoder import decoder_config, decoder_keys

MODEL_TYPES = ("llama", "mistral")
TIED_DEFAULT = False


def model_keys(hf: HFConfig) -> dict[str, Any]:
    hf.require("attention_bias", (False,), False)  # transformers puts it on q, k, v and o alike
    hf.require("mlp_bias", (False,), False)
    keys = decoder_keys(hf, theta=10000.0, eps=1e-6 if hf.model_type == "llama" else 1e-5)
    if hf.model_type == "mistral":
        hf.full_attention(keys["max_position_embeddings"])
    return keys


def exports(cfg) -> bool:
    return cfg.architecture == "llama" and cfg.moe is None and not cfg.add_qkv_bias and not cfg.qk_layernorm


def refusal(cfg) -> str | None:
    return None


def hf_config(cfg) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "mlp_bias": False, **decoder_config(cfg)}
