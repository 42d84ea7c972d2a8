# The Llama decoder's weights under Hugging Face's names (LlamaForCausalLM and the variants here, as transformers
# saves them), both ways: each rule names one of our tensors and the HF tensors holding its values (our fused
# [q | k | v] and [gate | up] are their row-wise concatenations, ModelConfig.fused_segments); a sparse MoE layer's
# experts under the variant's own names (its MOE_WEIGHTS, read by the shared expert rules).
from __future__ import annotations

from runtime.schema.families.decoder import moe_rules


def weight_rules(cfg, Rule, family) -> list:
    """runtime/convert/hf_layout.py's rules (`Rule` is its _Rule) for every tensor but the untied output head, under the
    Llama decoder's names; a sparse MoE layer's experts under `family`'s (its MOE_WEIGHTS). Our qkv rows are
    [Q (nh*d) | K (ng*d) | V (ng*d)] blocks, not interleaved per head, and both sides apply RoPE in the
    rotate-half layout, so q/k need no permutation."""
    fused = cfg.fused_segments()
    qkv_names, qkv_rows = zip(*fused["attn.qkv"])
    gate_up_rows = tuple(r for _, r in fused["mlp.gate_up"])
    rules = [Rule("embed.word.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        rules += [
            Rule(o + "attn_norm.weight", (h + "input_layernorm.weight",)),
            Rule(o + "attn.qkv.weight", tuple(f"{h}self_attn.{p}.weight" for p in qkv_names), qkv_rows),
            Rule(o + "attn.proj.weight", (h + "self_attn.o_proj.weight",)),
            Rule(o + "mlp_norm.weight", (h + "post_attention_layernorm.weight",))]
        if cfg.add_qkv_bias:
            rules.append(Rule(o + "attn.qkv.bias", tuple(f"{h}self_attn.{p}.bias" for p in qkv_names), qkv_rows))
        if cfg.qk_layernorm:
            rules += [Rule(o + "attn.q_norm.weight", (h + "self_attn.q_norm.weight",)),
                      Rule(o + "attn.k_norm.weight", (h + "self_attn.k_norm.weight",))]
        rules += moe_rules(cfg, Rule, family, o, h) if cfg.moe and cfg.moe.is_moe_layer(i) else [
            Rule(o + "mlp.gate_up.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), gate_up_rows),
            Rule(o + "mlp.down.weight", (h + "mlp.down_proj.weight",))]
    return rules + [Rule("final_norm.weight", ("model.norm.weight",))]
