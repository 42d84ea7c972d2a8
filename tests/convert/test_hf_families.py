# The model families teams bring (Llama 3.1 with RoPE scaling, Llama 3.2 with a tied head, Qwen2.5, Qwen3 dense and
# MoE), each
# built at random and tiny by transformers itself: imported, our model gives transformers' logits (fp32, 1e-5
# relative), at positions past Llama 3.1's original context too; exported again, every tensor is bitwise the
# original and transformers loads the export as the same class. tests/runtime_parallel trains the same features
# under every layout.
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runtime.convert import load_hf_directory, save_hf_directory
from runtime.models import ModelConfig, build_model

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Llama 3.1's scaling with an original context of 16 and a frequency band that puts some of the 6 frequencies
# (head size 12) in each regime: kept, blended and slowed by `factor`.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
FAMILIES = {
    "llama3_1": ("LlamaConfig", "LlamaForCausalLM",
                 dict(max_position_embeddings=64, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE)),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama3_2_tied": ("LlamaConfig", "LlamaForCausalLM",
                      dict(max_position_embeddings=64, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE,
                           tie_word_embeddings=True)),
    "qwen2_5": ("Qwen2Config", "Qwen2ForCausalLM",
                dict(max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True)),
    # Qwen2.5's long-context setting: YaRN (x4 over an original 16), its attention factor on cos and sin.
    "qwen2_5_yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    # Qwen3's head size (20) is not hidden / heads (12): q has 80 rows, not 48.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(max_position_embeddings=64, rope_theta=1e6, head_dim=20)),
    # Qwen3-MoE: 8 experts of their own size (24), top 2 not renormalized, and layer 1 of 3 dense (mlp_only_layers)
    # with the dense FFN size (64).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(max_position_embeddings=64, rope_theta=1e6, head_dim=20, num_hidden_layers=3, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_normalized": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                             dict(max_position_embeddings=64, head_dim=12, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=40, norm_topk_prob=True)),
}


def _hf_model(family: str):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    return sharpened(getattr(transformers, model_class)(config))


def sharpened(model, *, norms: float = 0.1, weights: float = 5.0):
    """Non-trivial norms and biases (random, of std `norms`, added), and sharper attention than std 0.02 gives."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * norms)
            else:
                p.mul_(weights)
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_imports_exactly_and_exports_bitwise(tmp_path, family):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "original", safe_serialization=True)
    state, keys, _ = load_hf_directory(tmp_path / "original")
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size=hf.config.vocab_size)
    model = build_model(cfg).eval()
    model.load_state_dict(state, strict=True)
    # 48 positions: three times Llama 3.1's original context, where the scaled frequencies decide the logits.
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5

    out = save_hf_directory(tmp_path / "again", state, cfg, None)
    original, again = load_file(tmp_path / "original/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == [FAMILIES[family][1]]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, theirs)


def test_rope_scaling_without_it_would_differ(tmp_path):
    """The test above can fail: Llama 3.1's logits past the original context move when the scaling is ignored."""
    hf = _hf_model("llama3_1")
    hf.save_pretrained(tmp_path / "original", safe_serialization=True)
    state, keys, _ = load_hf_directory(tmp_path / "original")
    unscaled = ModelConfig.from_model_section({**keys, "rope_scaling": None}, tokenizer_vocab_size=96)
    model = build_model(unscaled).eval()
    model.load_state_dict(state)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() > 1e-3
