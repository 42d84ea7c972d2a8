# DeepSeek-V3 (DeepseekV3ForCausalLM, model_type "deepseek_v3"), everything that knows it: config.json <-> our
# `model:` keys (here, standard library only: the launcher imports this package without torch), the network
# composed from the shared pieces plus multi-head latent attention (model.py), Hugging Face's weight names both
# ways (weights.py). Its MoE layers are the shared SparseMoE with DeepSeek's switches (MoEConfig's score_bias,
# groups / top_groups, routed_scaling_factor, shared_ffn_hidden_size); its first first_k_dense_replace layers are
# dense SwiGLUs (model.moe.layers lists the others). Multi-token prediction layers and FP8 weights are refused.
from __future__ import annotations

import re
import sys
from typing import Any

from runtime.schema.architecture import Architecture

# What the shared code asks of the network (runtime/schema/architecture.py): SwiGLU, RMSNorms, one YaRN/plain RoPE
# table (the qk_rope_head_dim channels), the ModelConfig keys it computes beyond the common shape.
ARCHITECTURE = Architecture(
    "deepseek_v3", network="runtime.families.deepseek_v3.model:MODEL",
    weights="runtime.families.deepseek_v3.weights", gated_mlp=True, rotary=True, biases=False, rms_norm=True,
    embedding_dropout=False, tied_default=False, switches=("rope_scaling", "latent_attention", "moe"), moe=True,
    arithmetic="runtime.families.deepseek_v3.sizes")
MODEL_TYPES = ("deepseek_v3",)
TIED_DEFAULT = False
# DeepseekV3Config's defaults where config.json leaves a key out.
_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
             "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
             "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-6, "rope_interleave": True}
_THETA = 10000.0


def model_keys(hf) -> dict[str, Any]:
    """config.json (a runtime.schema.families.base.HFConfig) -> our `model:` keys."""
    from runtime.schema.families.base import HFConfig

    hf.refuse_quantized("DeepSeek-V3", "DeepSeek's inference/fp8_cast_bf16.py, or transformers: from_pretrained "
                                       "with quantization_config=FineGrainedFP8Config(dequantize=True), then "
                                       "save_pretrained")
    hf.require("hidden_act", ("silu",), "silu")
    hf.require("attention_bias", (False,), False)
    q_rank = hf.data.get("q_lora_rank", _DEFAULTS["q_lora_rank"])  # null: one q projection, no low rank
    hf = HFConfig({**_DEFAULTS, **{k: v for k, v in hf.data.items() if v is not None}})
    heads = hf.count("num_attention_heads")
    kv = hf.data.get("num_key_value_heads")
    if kv is not None and int(kv) != heads:
        raise ValueError(f"config.json num_key_value_heads={kv}: DeepSeek-V3's latent attention expands keys and "
                         f"values to every head; supported: num_attention_heads ({heads}) or null")
    layers, dense = hf.count("num_hidden_layers"), int(hf.get("first_k_dense_replace"))
    if not 0 <= dense < layers:
        raise ValueError(f"config.json first_k_dense_replace={dense} must be from 0 to num_hidden_layers - 1 "
                         f"({layers - 1}): at least one MoE layer")
    experts, groups = hf.count("n_routed_experts"), hf.count("n_group")
    if experts % groups or experts // groups < 2:
        raise ValueError(f"config.json n_group={groups} must divide n_routed_experts ({experts}) into groups of at "
                         "least 2 experts (a group is ranked by its two best scores)")
    latent = {"kv_lora_rank": hf.count("kv_lora_rank"), "qk_nope_head_dim": hf.count("qk_nope_head_dim"),
              "qk_rope_head_dim": hf.count("qk_rope_head_dim"), "v_head_dim": hf.count("v_head_dim"),
              "q_lora_rank": None if q_rank is None else hf.count("q_lora_rank"),
              "rope_interleave": bool(hf.get("rope_interleave"))}
    if latent["qk_rope_head_dim"] % 2:
        raise ValueError(f"config.json qk_rope_head_dim={latent['qk_rope_head_dim']} must be even (RoPE rotates "
                         "pairs of channels)")
    shared = int(hf.get("n_shared_experts", 0) or 0)
    moe_ffn = hf.count("moe_intermediate_size")
    return {"architecture": ARCHITECTURE.name, "hidden_size": hf.count("hidden_size"), "num_layers": layers,
            "num_attention_heads": heads, "ffn_hidden_size": hf.count("intermediate_size"),
            "kv_channels": latent["v_head_dim"], "layernorm_epsilon": float(hf.get("rms_norm_eps")),
            "max_position_embeddings": hf.count("max_position_embeddings"),
            "attention_dropout": float(hf.get("attention_dropout", 0.0)), **hf.rope(_THETA),
            "latent_attention": latent,
            "moe": {"num_experts": experts, "top_k": hf.count("num_experts_per_tok"), "frequency": 1,
                    "layers": list(range(dense, layers)), "capacity_factor": None, "router_aux_loss_coef": 0.0,
                    "router_z_loss_coef": 0.0, "normalize_top_k_affinities": bool(hf.get("norm_topk_prob")),
                    "router_activation": "sigmoid", "ffn_hidden_size": moe_ffn, "score_bias": True,
                    "groups": groups, "top_groups": hf.count("topk_group"),
                    "routed_scaling_factor": float(hf.get("routed_scaling_factor")),
                    "shared_ffn_hidden_size": moe_ffn * shared or None}}


def exports(cfg) -> bool:
    return cfg.architecture == ARCHITECTURE.name


def refusal(cfg) -> str | None:
    moe = cfg.moe
    first = min(moe.layers) if moe.layers is not None else 0
    refusals = [
        (moe.layers is None or list(moe.layers) != list(range(first, cfg.num_layers)),
         f"model.moe.layers: DeepseekV3ForCausalLM's MoE layers are the last ones (first_k_dense_replace on); "
         f"list range({first}, {cfg.num_layers})"),
        (moe.capacity_factor is not None, f"model.moe.capacity_factor={moe.capacity_factor}: DeepseekV3ForCausalLM "
                                          "is dropless; export with model.moe.dropless=true"),
        (moe.router_activation != "sigmoid" or not moe.score_bias,
         "model.moe.router_activation / score_bias: DeepseekV3ForCausalLM scores experts by sigmoid with a "
         "selection bias; set router_activation=sigmoid, score_bias=true"),
        (moe.shared_ffn_hidden_size is not None and moe.shared_ffn_hidden_size % moe.expert_size(cfg.ffn_hidden_size),
         f"model.moe.shared_ffn_hidden_size={moe.shared_ffn_hidden_size}: DeepseekV3ForCausalLM's shared experts "
         "are a multiple of model.moe.ffn_hidden_size wide"),
    ]
    return next((message for refused, message in refusals if refused), None)


def hf_config(cfg) -> dict[str, Any]:
    from runtime.schema.families.base import rope_export

    latent, moe = cfg.latent_attention, cfg.moe
    rope = rope_export(cfg)
    rope_parameters = {"rope_theta": rope["rope_theta"], **(rope.get("rope_scaling") or {"rope_type": "default"})}
    expert = moe.expert_size(cfg.ffn_hidden_size)
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "moe_intermediate_size": expert, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
            "n_shared_experts": (moe.shared_ffn_hidden_size or 0) // expert, "n_routed_experts": moe.num_experts,
            "routed_scaling_factor": moe.routed_scaling_factor, "kv_lora_rank": latent.kv_lora_rank,
            "q_lora_rank": latent.q_lora_rank, "qk_rope_head_dim": latent.qk_rope_head_dim,
            "v_head_dim": latent.v_head_dim, "qk_nope_head_dim": latent.qk_nope_head_dim,
            "n_group": moe.groups, "topk_group": moe.top_groups, "num_experts_per_tok": moe.top_k,
            "first_k_dense_replace": min(moe.layers), "norm_topk_prob": moe.normalize_top_k_affinities,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.layernorm_epsilon, "rope_interleave": latent.rope_interleave,
            "attention_bias": False, "attention_dropout": cfg.attention_dropout,
            "rope_parameters": rope_parameters}


_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def normalized_state(state: dict) -> dict:
    """The names our rules use: transformers 5.x's fused experts (save_original_format=False: gate_up_proj
    (E, 2F, H) with [gate | up] rows, down_proj (E, H, F)) split per expert; the multi-token prediction layers
    (config.json num_nextn_predict_layers: the layers holding an eh_proj, past the decoder's) dropped, as
    transformers drops them, with a note naming the key."""
    mtp = {m.group(1) for name in state if name.endswith(".eh_proj.weight") and (m := _LAYER.match(name))}
    if mtp:
        print(f"note: config.json num_nextn_predict_layers: the multi-token prediction layer(s) "
              f"{', '.join(sorted(mtp, key=int))} are not used here; their weights are ignored", file=sys.stderr)
    out = {}
    for name, tensor in state.items():
        layer = _LAYER.match(name)
        if layer is not None and layer.group(1) in mtp:
            continue
        fused = _FUSED.match(name)
        if fused is None:
            out[name] = tensor
        elif fused.group(2) == "down_proj":
            out.update({f"{fused.group(1)}{e}.down_proj.weight": m for e, m in enumerate(tensor.unbind(0))})
        else:
            for e, matrix in enumerate(tensor.unbind(0)):
                gate, up = matrix.chunk(2)
                out[f"{fused.group(1)}{e}.gate_proj.weight"], out[f"{fused.group(1)}{e}.up_proj.weight"] = gate, up
    return out
