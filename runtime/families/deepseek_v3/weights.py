# DeepSeek-V3's Hugging Face weight names (DeepseekV3ForCausalLM as its checkpoints hold them, bf16/fp32) for each
# of our tensors: renames, but the dense and shared SwiGLUs' [gate | up] (joined by rows) and the routed experts,
# stored one nn.Linear per expert (mlp.experts.{e}.gate_proj / up_proj / down_proj, which transformers 5 merges on
# load and splits again on save) as Qwen3-MoE's are: the shared decoder's expert rules read them.
from __future__ import annotations

import types

from runtime.schema.families.decoder import moe_rules

# The names the shared expert rules take: router, then each expert's gate, up and down.
_EXPERTS = types.SimpleNamespace(MOE_WEIGHTS=("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                                              "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"))


def weight_rules(cfg, rule, family=None) -> list:
    """runtime/convert/hf_layout.py's rules (`rule` is its _Rule) for every tensor but the untied output head."""
    latent, moe = cfg.latent_attention, cfg.moe
    names = [rule("embed.word.weight", ("model.embed_tokens.weight",))]
    attn = attention_names(latent)
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        names += [rule(f"{o}attn.{ours}.weight", (f"{h}self_attn.{theirs}.weight",)) for ours, theirs in attn.items()]
        names += [rule(o + "attn_norm.weight", (h + "input_layernorm.weight",)),
                  rule(o + "mlp_norm.weight", (h + "post_attention_layernorm.weight",))]
        if moe.is_moe_layer(i):
            names += moe_rules(cfg, rule, _EXPERTS, o, h)
            names.append(rule(o + "mlp.selection.bias", (h + "mlp.gate.e_score_correction_bias",)))
            if moe.shared_ffn_hidden_size:
                names += _swiglu(rule, o + "mlp.shared.", h + "mlp.shared_experts.", moe.shared_ffn_hidden_size)
        else:
            names += _swiglu(rule, o + "mlp.", h + "mlp.", cfg.ffn_hidden_size)
    names.append(rule("final_norm.weight", ("model.norm.weight",)))
    return names


def attention_names(latent) -> dict[str, str]:
    """LatentAttention's projections and norms (model.py) -> DeepseekV3Attention's (self_attn.<name>): the weights'
    names here, LoRA's target names (model.peft.target_modules) for the projections."""
    attn = {"kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj", "proj": "o_proj"}
    attn.update({"q": "q_proj"} if latent.q_lora_rank is None else
                {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj"})
    return attn


def _swiglu(rule, ours: str, theirs: str, ffn: int) -> list:
    return [rule(ours + "gate_up.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"), (ffn, ffn)),
            rule(ours + "down.weight", (theirs + "down_proj.weight",))]
