# Gemma 3 text (runtime/families/gemma3), built tiny and at random by transformers itself: 2 layers of every 3 slide
# a window of 64 over 1,100 tokens, the full layers scale RoPE (linear, as 4B+ do), every norm weight is far from
# zero. Imported, our per-token log-probs are transformers' (fp32, 2e-4); exported, every tensor is bitwise the
# original and transformers loads the export with no missing or unexpected key and gives the same logits.
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from runtime.convert import load_hf_directory, save_hf_directory
from runtime.models import ModelConfig, build_model
from tests.convert.test_hf_families import sharpened

transformers = pytest.importorskip("transformers")

TOKENS = 1100
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=64,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              max_position_embeddings=2048, rope_theta=1e6, rope_local_base_freq=10000.0,
              rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def gemma3_hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{**CONFIG, **overrides})
    # Norm weights far from transformers' zero start (1 + w = 1), attention sharper than std 0.02 gives.
    return sharpened(transformers.Gemma3ForCausalLM(config), norms=0.3, weights=3.0)


def _log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    hf = gemma3_hf_model()
    hf.save_pretrained(directory / "original", safe_serialization=True)
    state, keys, _ = load_hf_directory(directory / "original")
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size=hf.config.vocab_size)
    model = build_model(cfg).eval()
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs = hf(ids).logits
    return directory, hf, state, cfg, model, ids, theirs


def test_imports_exactly(imported):
    _, _, _, cfg, model, ids, theirs = imported
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (cfg.sliding_window, cfg.local_rotary_base, cfg.rotary_base) == (64, 10000.0, 1e6)
    with torch.no_grad():
        ours = model(ids)
    assert (_log_probs(ours, ids) - _log_probs(theirs, ids)).abs().max().item() <= 2e-4


def test_exports_bitwise_and_transformers_loads_it(imported):
    directory, _, state, cfg, _, ids, theirs = imported
    out = save_hf_directory(directory / "again", state, cfg, None)
    original, again = load_file(directory / "original/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).logits, theirs)


@pytest.mark.parametrize("change", ["window", "local_base", "scale", "norm"])
def test_each_gemma_feature_moves_the_log_probs(imported, change):
    """The comparison above can fail: dropping any one feature moves the log-probs far past its bound."""
    _, _, state, cfg, _, ids, theirs = imported
    import dataclasses

    wrong = {"window": dict(sliding_window=4096), "local_base": dict(local_rotary_base=None),
             "scale": dict(softmax_scale=None), "norm": {}}[change]
    model = build_model(dataclasses.replace(cfg, **wrong)).eval()
    model.load_state_dict(state if change != "norm" else
                          {k: (v + 1 if k.endswith("norm.weight") else v) for k, v in state.items()})
    with torch.no_grad():
        ours = model(ids)
    assert (_log_probs(ours, ids) - _log_probs(theirs, ids)).abs().max().item() > 1e-2


@pytest.mark.parametrize("change, expected", [
    ({"final_logit_softcapping": 30.0}, "config.json final_logit_softcapping=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "config.json attn_logit_softcapping=50.0 is not supported"),
    ({"hidden_activation": "gelu"}, "config.json hidden_activation='gelu' is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "config.json layer_types="),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention scales RoPE"),
    ({"model_type": "gemma3"}, "config.json model_type='gemma3': Gemma3ForConditionalGeneration (image and text)"),
])
def test_what_we_do_not_compute_is_refused_naming_the_key(change, expected):
    from runtime.schema.model import hf_model_keys

    with pytest.raises(ValueError, match=re.escape(expected)):
        hf_model_keys({**CONFIG, "model_type": "gemma3_text", **change})


def test_both_rope_forms_read_alike(imported):
    """transformers 5.x writes rope_parameters by layer type; the Hub's config.json files (4.x) hold rope_theta,
    rope_scaling, rope_local_base_freq and sliding_window_pattern instead of layer_types: the same model keys."""
    from runtime.schema.model import hf_model_keys

    directory = imported[0]
    written = json.loads((directory / "original/config.json").read_text())
    assert set(written["rope_parameters"]) == {"full_attention", "sliding_attention"}
    hub = {k: v for k, v in written.items() if k not in ("rope_parameters", "layer_types")}
    hub.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000.0,
               sliding_window_pattern=3)
    assert hf_model_keys(hub) == hf_model_keys(written)
    assert hf_model_keys({**hub, "rope_local_base_freq": 20000.0})["local_rotary_base"] == 20000.0


def test_greedy_generation_with_a_kv_cache_is_transformers(imported):
    """Through runtime.generate's preallocated KV cache, past the window and in a left-padded batch: the tokens of
    greedy decoding by transformers' whole-sequence forward (5.24's generate() does not reproduce that forward's
    logits once a prompt is longer than the window: 0.25 apart here, a different first token)."""
    from runtime.generate import generate

    _, hf, _, _, model, ids, _ = imported
    prompts = [ids[0, :70].tolist(), ids[0, 300:350].tolist()]
    with torch.no_grad():
        ours = generate(model, prompts, max_new_tokens=30)
        for prompt, tokens in zip(prompts, ours):
            row = list(prompt)
            for _ in range(30):
                row.append(int(hf(torch.tensor([row])).logits[0, -1].argmax()))
            assert tokens == row[len(prompt):]


def test_a_ranks_slices_are_the_whole_models_rows(imported):
    """What a tensor-parallel rank reads (hf.SlicedReader, by the family's rules): bitwise the rows of the import."""
    from runtime.convert.hf import SlicedReader

    directory, _, state, cfg, _, _, _ = imported
    reader = SlicedReader(directory / "original", cfg)
    assert reader.available
    reader.check()
    for name, tensor in state.items():
        assert torch.equal(reader.read(name), tensor), name
        rows = torch.arange(1, tensor.shape[0], 3)  # a strided selection that crosses the q | k | v parts
        assert torch.equal(reader.read(name, {0: rows}), tensor[rows]), name
