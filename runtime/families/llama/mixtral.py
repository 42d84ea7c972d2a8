# Mixtral (MixtralForCausalLM): the Llama decoder with a sparse MoE block in every layer; a softmax router over
# all experts, the top_k renormalized, dropless.
# One of the llama folder's VARIANTS; the shared readers are imported where used (see __init__.py).
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.schema.families.base import HFConfig

MODEL_TYPES = ("mixtral",)
TIED_DEFAULT = False
# Within a layer: the router, then each expert e's gate, up and down projections, as transformers saves them
# (its 5.x in-memory fused names import too: runtime/convert/hf.py).
MOE_WEIGHTS = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
               "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")


def model_keys(hf: HFConfig) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_keys, softmax_moe_keys

    keys = decoder_keys(hf, "llama", theta=1e6, eps=1e-5)
    hf.full_attention(keys["max_position_embeddings"])
    hf.require("router_jitter_noise", (0.0,), 0.0)  # training-time input noise our router does not add
    keys["moe"] = softmax_moe_keys(hf, top_k=2)
    return keys


def exports(cfg) -> bool:
    return cfg.architecture == "llama" and cfg.moe is not None and not cfg.qk_layernorm


def refusal(cfg) -> str | None:
    """MixtralForCausalLM computes one MoE variant; refuse the others rather than export a model that transformers
    would run differently. The router's z-loss coefficient is not refused: it only shapes training, as dropout."""
    moe = cfg.moe
    refusals = [
        (cfg.add_qkv_bias, "model.add_qkv_bias=true: MixtralForCausalLM has no attention biases"),
        (moe.layers is not None, f"model.moe.layers={list(moe.layers or ())}: MixtralForCausalLM has an MoE block in "
                                 "every layer; only null can be exported"),
        (moe.ffn_hidden_size not in (None, cfg.ffn_hidden_size),
         f"model.moe.ffn_hidden_size={moe.ffn_hidden_size}: Mixtral's experts are model.ffn_hidden_size wide; only "
         "null can be exported"),
        (moe.frequency != 1, f"model.moe.frequency={moe.frequency}: MixtralForCausalLM has an MoE block in every "
                             "layer; only frequency 1 can be exported"),
        (moe.router_activation != "softmax", f"model.moe.router_activation={moe.router_activation!r}: Mixtral's "
                                             "router is a softmax; only softmax can be exported"),
        (not moe.normalize_top_k_affinities, "model.moe.normalize_top_k_affinities=false: Mixtral always "
                                             "renormalizes the top_k weights; only true can be exported"),
        (moe.capacity_factor is not None, f"model.moe.capacity_factor={moe.capacity_factor}: MixtralForCausalLM is "
                                          "dropless, so transformers would compute this model without dropping "
                                          "tokens; export with model.moe.dropless=true (capacity_factor null) to "
                                          "accept that difference"),
    ]
    return next((message for refused, message in refusals if refused), None)


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.decoder import decoder_config

    # output_router_logits false: transformers adds the load-balancing loss only when it is true, but the
    # coefficient is kept so that fine-tuning in transformers can switch it on with the value this model used.
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
            "router_aux_loss_coef": cfg.moe.router_aux_loss_coef, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None, **decoder_config(cfg)}


def normalized_state(state: dict) -> dict:
    """transformers 5.x's fused names (save_original_format=False) -> the per-expert names our rules use:
    mlp.gate.weight is the router; mlp.experts.gate_up_proj (E, 2F, H) holds [w1 | w3] rows per expert and
    mlp.experts.down_proj (E, H, F) holds w2 per expert."""
    fused = re.compile(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")
    out = {}
    for name, tensor in state.items():
        match = fused.match(name)
        if match is None:
            out[name] = tensor
            continue
        m = match.group(1) + "block_sparse_moe."
        if match.group(2) == "gate.weight":
            out[m + "gate.weight"] = tensor
        elif match.group(2) == "experts.down_proj":
            out.update({f"{m}experts.{e}.w2.weight": matrix for e, matrix in enumerate(tensor.unbind(0))})
        else:
            for e, matrix in enumerate(tensor.unbind(0)):
                gate, up = matrix.chunk(2)
                out.update({f"{m}experts.{e}.w1.weight": gate, f"{m}experts.{e}.w3.weight": up})
    return out
