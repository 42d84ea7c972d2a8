# Qwen2 / Qwen2.5 (Qwen2ForCausalLM): the Llama decoder with biases on q, k and v (none on the output
# projection), RoPE theta 1e6 in the released models, the head tied in the small ones.
# One of the llama folder's VARIANTS; the shared readers are imported where used (see __init__.py).
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.schema.families.base import HFConfig

MODEL_TYPES = ("qwen2",)
TIED_DEFAULT = False


def model_keys(hf: HFConfig) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_keys

    keys = decoder_keys(hf, "llama", theta=10000.0, eps=1e-6)
    hf.full_attention(keys["max_position_embeddings"])
    return {**keys, "add_qkv_bias": True}


def exports(cfg) -> bool:
    return cfg.architecture == "llama" and cfg.moe is None and cfg.add_qkv_bias and not cfg.qk_layernorm


def refusal(cfg) -> str | None:
    return None


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_config

    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": cfg.num_layers, **decoder_config(cfg)}
