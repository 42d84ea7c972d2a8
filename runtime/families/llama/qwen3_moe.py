# Qwen3-MoE (Qwen3MoeForCausalLM; Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms, a head
# size of its own) with a sparse MoE block of many small experts (moe_intermediate_size) in the layers that
# decoder_sparse_step and mlp_only_layers leave sparse; a softmax router whose top_k weights are renormalized only
# with norm_topk_prob; dropless; no shared expert.
# One of the llama folder's VARIANTS; the shared readers are imported where used (see __init__.py).
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.schema.families.base import HFConfig

MODEL_TYPES = ("qwen3_moe",)
TIED_DEFAULT = False
MOE_WEIGHTS = ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
               "mlp.experts.{e}.down_proj.weight")


def model_keys(hf: HFConfig) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_keys

    hf.require("attention_bias", (False,), False)
    keys = decoder_keys(hf, "llama", theta=10000.0, eps=1e-6)
    if hf.data.get("head_dim") is None:
        keys["kv_channels"] = 128
    hf.full_attention(keys["max_position_embeddings"])
    layers = keys["num_layers"]
    step = hf.count("decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"config.json mlp_only_layers={dense!r} must be a list of layer indexes")
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    num_experts = hf.data.get("num_experts") or hf.count("num_local_experts")  # 5.x writes the second
    keys["moe"] = {"num_experts": int(num_experts), "top_k": hf.count("num_experts_per_tok", 8), "frequency": 1,
                   "capacity_factor": None, "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
                   "router_z_loss_coef": 0.0, "normalize_top_k_affinities": bool(hf.get("norm_topk_prob", False)),
                   "router_activation": "softmax", "ffn_hidden_size": hf.count("moe_intermediate_size", 768),
                   "layers": None if len(sparse) == layers else list(sparse)}
    return {**keys, "qk_layernorm": True}


def exports(cfg) -> bool:
    return cfg.architecture == "llama" and cfg.moe is not None and cfg.qk_layernorm


def refusal(cfg) -> str | None:
    moe = cfg.moe
    refusals = [
        (cfg.add_qkv_bias, "model.add_qkv_bias=true: Qwen3MoeForCausalLM's attention_bias puts a bias on the "
                           "output projection too; only false can be exported"),
        (moe.router_activation != "softmax", f"model.moe.router_activation={moe.router_activation!r}: Qwen3-MoE's "
                                             "router is a softmax; only softmax can be exported"),
        (moe.capacity_factor is not None, f"model.moe.capacity_factor={moe.capacity_factor}: Qwen3MoeForCausalLM is "
                                          "dropless; export with model.moe.dropless=true (capacity_factor null) to "
                                          "accept that difference"),
        (moe.layers is None and moe.frequency != 1, f"model.moe.frequency={moe.frequency}: Qwen3-MoE's sparse "
                                                    "layers are listed (model.moe.layers), not every n-th from the "
                                                    "first; set model.moe.layers instead"),
    ]
    return next((message for refused, message in refusals if refused), None)


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_config

    moe = cfg.moe
    sparse = set(moe.layers) if moe.layers is not None else set(range(cfg.num_layers))
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_size(cfg.ffn_hidden_size), "decoder_sparse_step": 1,
            "mlp_only_layers": sorted(set(range(cfg.num_layers)) - sparse), "norm_topk_prob":
            moe.normalize_top_k_affinities, "router_aux_loss_coef": moe.router_aux_loss_coef,
            "output_router_logits": False, **decoder_config(cfg)}
