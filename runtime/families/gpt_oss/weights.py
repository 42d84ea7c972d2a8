# GPT-OSS's Hugging Face weight names (transformers 5.x, as GptOssForCausalLM saves bf16/fp32 weights) for each of
# our tensors. Every one is a rename but the fused [q | k | v] (and its bias): the experts are stored as ours are,
# gate_up_proj (E, H, 2F) with gate/up columns interleaved, down_proj (E, F, H), each with its (E, .) bias.
from __future__ import annotations


def weight_rules(cfg, rule, family=None) -> list:
    """runtime/convert/hf_layout.py's rules (`rule` is its _Rule) for every tensor but the untied output head (`family`:
    this one)."""
    d, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.kv_heads
    qkv_rows = (heads * d, kv * d, kv * d)
    names = [rule("embed.word.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        names += [rule(o + "attn.qkv." + kind, tuple(f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"), qkv_rows)
                  for kind in ("weight", "bias")]
        renames = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                   "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias",
                   "attn.sinks": "self_attn.sinks", "mlp.router.weight": "mlp.router.weight",
                   "mlp.router.bias": "mlp.router.bias", "mlp.gate_up": "mlp.experts.gate_up_proj",
                   "mlp.gate_up_bias": "mlp.experts.gate_up_proj_bias", "mlp.down": "mlp.experts.down_proj",
                   "mlp.down_bias": "mlp.experts.down_proj_bias"}
        names += [rule(o + ours, (h + theirs,)) for ours, theirs in renames.items()]
    names.append(rule("final_norm.weight", ("model.norm.weight",)))
    return names
