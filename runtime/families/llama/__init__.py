# Llama: the Llama decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention), everything that knows it:
# the network (model.py), Hugging Face's weight names both ways (weights.py), and here config.json <-> our `model:`
# keys, the protocol of runtime/schema/families, for Llama 2 / 3 / 3.1-3.3 (LlamaForCausalLM) and Mistral
# (MistralForCausalLM: the same layers and weight names, accepted without a sliding window); Llama 3.1+ scales RoPE
# (rope_type llama3), Llama 3.2 1B/3B tie the head. The Hugging Face families ModelConfig's switches make of the
# same decoder (biases on q/k/v, per-head q/k norms, MoE) are a module each here, VARIANTS. ARCHITECTURE is the
# registry entry (runtime/schema/architecture.py). Standard library only: the launcher imports it without torch; the
# shared readers (runtime/schema/families/base.py, decoder.py) are imported where used, as the registry imports this
# package while it loads.
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.families.llama import mixtral, qwen2, qwen3, qwen3_moe
from runtime.schema.architecture import Architecture

if TYPE_CHECKING:
    from runtime.schema.families.base import HFConfig

# What the shared code asks of the network: SwiGLU, one RoPE table, RMSNorms, no biases, an untied head; the
# ModelConfig switches it computes (Qwen2's q/k/v biases, Qwen3's q/k norms, RoPE scaling), model.moe's sparse
# layers (Mixtral, Qwen3-MoE), and the NeMo / NxD megatron switches that name it.
ARCHITECTURE = Architecture(
    "llama", network="runtime.families.llama.model:MODEL", weights="runtime.families.llama.weights", gated_mlp=True,
    rotary=True, biases=False, rms_norm=True, embedding_dropout=False, tied_default=False,
    switches=("add_qkv_bias", "qk_layernorm", "rope_scaling"), moe=True,
    megatron=(("rmsnorm", "rope", "swiglu", False), ("rmsnorm", "rope", "fast-swiglu", False)),
    tiny_recipe="llama/tiny", sizes="Llama 3")
# The other Hugging Face families of this decoder, in the order the registry tries them (before this one's own) for
# an export; each exports() holds for its own combination of the switches only.
VARIANTS = (qwen3_moe, mixtral, qwen3, qwen2)
MODEL_TYPES = ("llama", "mistral")
# torchtitan 0.3's model of this network at Llama 3 shapes (training.runtime=torchtitan; runtime/families/llama/titan.py).
TORCHTITAN = "llama3"
TIED_DEFAULT = False


def model_keys(hf: HFConfig) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_keys

    hf.require("attention_bias", (False,), False)  # transformers puts it on q, k, v and o alike
    hf.require("mlp_bias", (False,), False)
    keys = decoder_keys(hf, ARCHITECTURE.name, theta=10000.0, eps=1e-6 if hf.model_type == "llama" else 1e-5)
    if hf.model_type == "mistral":
        hf.full_attention(keys["max_position_embeddings"])
    return keys


def exports(cfg) -> bool:
    return cfg.architecture == ARCHITECTURE.name and cfg.moe is None and not cfg.add_qkv_bias and not cfg.qk_layernorm


def refusal(cfg) -> str | None:
    return None


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_config

    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "mlp_bias": False, **decoder_config(cfg)}
