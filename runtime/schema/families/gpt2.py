# GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, GELU (tanh), biases everywhere, Conv1D weights.
from __future__ import annotations

from typing import Any

from runtime.schema.families.base import HFConfig

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
    return {"architecture": "gpt", "hidden_size": hidden, "num_layers": hf.count("n_layer"),
            "num_attention_heads": hf.count("n_head"), "num_query_groups": None,
            "ffn_hidden_size": hf.count("n_inner", 4 * hidden),
            "layernorm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "max_position_embeddings": hf.count("n_positions")}


def exports(cfg) -> bool:
    return cfg.architecture == "gpt"


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


def weight_rules(cfg, Rule, family=None) -> list:
    """runtime/convert/hf_layout.py's rules (`Rule` is its _Rule) for every tensor but the untied output head: GPT-2's
    Conv1D weights store (in, out), the transpose of our nn.Linear. (`family`: this one.)"""
    rules = [Rule("embed.word.weight", (EMBEDDING,)), Rule("embed.position.weight", ("transformer.wpe.weight",))]
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"transformer.h.{i}."
        for ours, hf, linear in [("attn_norm", "ln_1", False), ("mlp_norm", "ln_2", False),
                                 ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
                                 ("mlp.fc1", "mlp.c_fc", True), ("mlp.fc2", "mlp.c_proj", True)]:
            rules += [Rule(o + ours + ".weight", (h + hf + ".weight",), transpose=linear),
                      Rule(o + ours + ".bias", (h + hf + ".bias",))]
    return rules + [Rule("final_norm.weight", ("transformer.ln_f.weight",)),
                    Rule("final_norm.bias", ("transformer.ln_f.bias",))]
