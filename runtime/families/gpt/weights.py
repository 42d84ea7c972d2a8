# GPT's weights under GPT-2's Hugging Face names (GPT2LMHeadModel, as transformers saves it), both ways: each rule
# names one of our tensors and the HF tensor holding its values. GPT-2's Conv1D weights store (in, out), the
# transpose of our nn.Linear; our fused qkv is its c_attn as it stands.
from __future__ import annotations

from runtime.families.gpt import EMBEDDING


def weight_rules(cfg, Rule, family=None) -> list:
    """runtime/convert/hf_layout.py's rules (`Rule` is its _Rule) for every tensor but the untied output head
    (`family`: this one)."""
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
