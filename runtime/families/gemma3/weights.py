# Gemma 3's weights under Hugging Face's names (Gemma3ForCausalLM, as transformers saves it), both ways: each rule
# names one of our tensors and the HF tensors holding its values (our fused [q | k | v] and [gate | up] are their
# row-wise concatenations, ModelConfig.fused_segments). Tensor parallelism splits them by those same segments
# (runtime/parallel/parallelize.py: column-parallel qkv and gate_up, row-parallel proj and down; norms replicated).
from __future__ import annotations

from runtime.schema.model import ModelConfig

# Our block's modules -> Gemma3DecoderLayer's, for the plain (one HF tensor) weights.
_RENAMES = (("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
            ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm"),
            ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"),
            ("attn.proj", "self_attn.o_proj"), ("mlp.down", "mlp.down_proj"))


def weight_rules(cfg: ModelConfig, Rule, family=None) -> list:
    """runtime/convert/hf_layout.py's rules (`Rule` is its _Rule) for every tensor but the untied output head (`family`:
    this one)."""
    fused = cfg.fused_segments()
    qkv_names, qkv_rows = zip(*fused["attn.qkv"])
    gate_up_names, gate_up_rows = zip(*fused["mlp.gate_up"])
    out = [Rule("embed.word.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        out += [Rule(f"{o}{ours}.weight", (f"{h}{theirs}.weight",)) for ours, theirs in _RENAMES]
        out += [Rule(o + "attn.qkv.weight", tuple(f"{h}self_attn.{p}.weight" for p in qkv_names), qkv_rows),
                Rule(o + "mlp.gate_up.weight", tuple(f"{h}mlp.{p}.weight" for p in gate_up_names), gate_up_rows)]
    return out + [Rule("final_norm.weight", ("model.norm.weight",))]
