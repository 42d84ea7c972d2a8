# Qwen3 dense (Qwen3ForCausalLM): the Llama decoder with an RMSNorm over each query and key head before RoPE
# (q_norm, k_norm) and a head size set apart from hidden_size / heads (head_dim: 128 in every released size).
# One of the llama folder's VARIANTS; the shared readers are imported where used (see __init__.py).
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.schema.families.base import HFConfig

MODEL_TYPES = ("qwen3",)
TORCHTITAN = "qwen3"  # torchtitan 0.3's dense Qwen3 (runtime/families/llama/titan.py builds it)
TIED_DEFAULT = False


def model_keys(hf: HFConfig) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_keys

    hf.require("attention_bias", (False,), False)  # Qwen3 puts it on q, k, v and o alike
    keys = decoder_keys(hf, "llama", theta=10000.0, eps=1e-6)
    if hf.data.get("head_dim") is None:  # the config class's default, not hidden / heads
        keys["kv_channels"] = 128
    hf.full_attention(keys["max_position_embeddings"])
    return {**keys, "qk_layernorm": True}


def exports(cfg) -> bool:
    return cfg.architecture == "llama" and cfg.moe is None and cfg.qk_layernorm


def refusal(cfg) -> str | None:
    if cfg.add_qkv_bias:
        return ("model.add_qkv_bias=true with model.qk_layernorm=true: no Hugging Face family computes it "
                "(Qwen3's attention_bias puts a bias on the output projection too)")
    return None


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_config

    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            **decoder_config(cfg)}
