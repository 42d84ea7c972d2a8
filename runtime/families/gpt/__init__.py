# GPT: GPT-3's block as GPT-2 (GPT2LMHeadModel, model_type gpt2) has it, everything that knows it: learned positions,
# LayerNorm, GELU (tanh), biases everywhere; the network (model.py), Hugging Face's Conv1D weight names both ways
# (weights.py), and here config.json <-> our `model:` keys, the protocol of runtime/schema/families, with
# ARCHITECTURE, its registry entry (runtime/schema/architecture.py). Standard library only: the launcher imports it
# without torch.
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.schema.architecture import Architecture

if TYPE_CHECKING:
    from runtime.schema.families.base import HFConfig

# What the shared code asks of the network: one fc1/fc2 GELU MLP, a learned position table, biases on every linear
# and norm, LayerNorms, dropout on the embeddings, a tied head; the NeMo / NxD megatron switches that name it.
ARCHITECTURE = Architecture(
    "gpt", network="runtime.families.gpt.model:MODEL", weights="runtime.families.gpt.weights", gated_mlp=False,
    rotary=False, biases=True, rms_norm=False, embedding_dropout=True, tied_default=True,
    megatron=(("layernorm", "learned_absolute", "gelu", True),), tiny_recipe="gpt3/tiny", sizes="GPT-3")
MODEL_TYPES = ("gpt2",)
TIED_DEFAULT = True
EMBEDDING = "transformer.wte.weight"
# Why a LoRA run cannot be exported as a PEFT adapter (runtime/convert/peft.py); None where it can.
PEFT_REFUSAL = ("conversion.lora: GPT-2 fuses q, k and v into one Conv1D (c_attn), so PEFT cannot hold our separate "
                "q/k/v adapters; export a GPT LoRA run with conversion.lora=merged")


def model_keys(hf: HFConfig) -> dict[str, Any]:
    hf.require("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")  # the same tanh GELU
    hf.require("scale_attn_weights", (True,), True)
    hf.require("scale_attn_by_inverse_layer_idx", (False,), False)
    hf.require("add_cross_attention", (False,), False)
    hidden = hf.count("n_embd")
    return {"architecture": ARCHITECTURE.name, "hidden_size": hidden, "num_layers": hf.count("n_layer"),
            "num_attention_heads": hf.count("n_head"), "num_query_groups": None,
            "ffn_hidden_size": hf.count("n_inner", 4 * hidden),
            "layernorm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "max_position_embeddings": hf.count("n_positions")}


def exports(cfg) -> bool:
    return cfg.architecture == ARCHITECTURE.name


def refusal(cfg) -> str | None:
    if cfg.kv_heads != cfg.num_attention_heads:
        return (f"model.num_query_groups={cfg.num_query_groups}: GPT2LMHeadModel has no grouped-query attention; "
                f"only num_query_groups = num_attention_heads ({cfg.num_attention_heads}) or null can be exported")
    if cfg.kv_channels is not None and cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        return f"model.kv_channels={cfg.kv_channels}: GPT2LMHeadModel's head size is n_embd / n_head"
    return None


def hf_config(cfg) -> dict[str, Any]:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.layernorm_epsilon,
            "activation_function": "gelu_new", "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False}


def normalized_state(state: dict) -> dict:
    """OpenAI's original GPT-2 files lack the "transformer." prefix."""
    if EMBEDDING in state:
        return state
    return {(k if k == "lm_head.weight" else "transformer." + k): v for k, v in state.items()}

