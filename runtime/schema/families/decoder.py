# The Llama decoder as config.json describes it, shared by the families built on it (runtime/families: the Llama
# decoder's own folder and those that reuse its shape keys or expert names): RMSNorm, SwiGLU, grouped-query
# attention, RoPE. Each family adds what sets it apart; none is named here.
from __future__ import annotations

from typing import Any

from runtime.schema.families.base import HFConfig, rope_export


def decoder_keys(hf: HFConfig, architecture: str, *, theta: float, eps: float) -> dict[str, Any]:
    """Our `model:` keys for the decoder's shape, norms and RoPE, for the caller's `model.architecture`; `theta` and
    `eps` are the defaults of the family's transformers config class, which its loader applies to an absent key."""
    hf.require("hidden_act", ("silu",), "silu")
    hidden, heads = hf.count("hidden_size"), hf.count("num_attention_heads")
    keys = {"architecture": architecture, "hidden_size": hidden, "num_layers": hf.count("num_hidden_layers"),
            "num_attention_heads": heads, "num_query_groups": hf.count("num_key_value_heads", heads),
            "ffn_hidden_size": hf.count("intermediate_size"),
            "layernorm_epsilon": float(hf.get("rms_norm_eps", eps)),
            "max_position_embeddings": hf.count("max_position_embeddings"), **hf.rope(theta)}
    head_dim = hf.get("head_dim", None)
    if head_dim is not None and (hidden % heads or hf.count("head_dim") != hidden // heads):
        keys["kv_channels"] = hf.count("head_dim")
    return keys


def decoder_config(cfg) -> dict[str, Any]:
    """The config.json keys of the decoder's shape, norms and RoPE, for an export."""
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
            "attention_dropout": cfg.attention_dropout, **rope_export(cfg)}


def moe_rules(cfg, Rule, family, o: str, h: str) -> list:
    """Our SparseMoE (router (E, H), gate_up (E, H, 2F) used as x @ gate_up[e], down (E, F, H)) as the family's
    nn.Linear weights per expert (its MOE_WEIGHTS): gate (F, H), up (F, H), down (H, F)."""
    router, gate, up, down = (h + name for name in family.MOE_WEIGHTS)
    experts, ffn = cfg.moe.num_experts, cfg.moe.expert_size(cfg.ffn_hidden_size)
    return [Rule(o + "mlp.router.weight", (router,)),
            Rule(o + "mlp.gate_up", tuple(name.format(e=e) for e in range(experts) for name in (gate, up)),
                 (ffn, ffn), transpose=True, experts=experts),
            Rule(o + "mlp.down", tuple(down.format(e=e) for e in range(experts)), transpose=True, experts=experts)]


def softmax_moe_keys(hf: HFConfig, *, top_k: int) -> dict[str, Any]:
    """`model.moe` for a dropless MoE block in every layer whose router's top-k softmax weights are renormalized
    (Mixtral's; GPT-OSS's softmax over the top-k logits is the same), from num_local_experts and
    num_experts_per_tok (`top_k`: the family's default). transformers adds router_aux_loss_coef * the
    load-balancing loss only with output_router_logits; the coefficient is still the model's recipe, so training
    here uses it (computed per layer, see models/moe.py)."""
    return {"num_experts": hf.count("num_local_experts"), "top_k": hf.count("num_experts_per_tok", top_k),
            "frequency": 1, "capacity_factor": None,
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)), "router_z_loss_coef": 0.0,
            "normalize_top_k_affinities": True, "router_activation": "softmax"}
