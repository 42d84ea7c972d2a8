# The Hugging Face converter checked against transformers itself: our models exported and loaded with
# AutoModelForCausalLM give the same logits, HF models imported into ours do too, and HF -> ours -> HF returns
# the original tensors bit for bit.
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runtime.convert import from_hf, load_hf_directory, model_keys, save_hf_directory, to_hf
from runtime.schema.data_preparation import TrainConfig
from runtime.data_prep.tokenizer_train import train_huggingface
from runtime.models import ModelConfig, build_model

transformers = pytest.importorskip("transformers")
TEXTS = ["the quick brown fox jumps over the lazy dog", "a tiny model learns a tiny language",
         "hello world, hello tokenizer"] * 20
SMALL = dict(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, max_position_embeddings=32)


def _tokenizer(path, specials: tuple[str, ...]) -> int:
    """A byte-level BPE from the project's own trainer; returns its size (added tokens included)."""
    from tokenizers import Tokenizer

    train = TrainConfig(vocab_size=300, special_tokens=specials, min_frequency=1)
    path.write_text(train_huggingface(iter(TEXTS), train), encoding="utf-8")
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def _our_model(cfg: ModelConfig):
    model = build_model(cfg).eval()
    _make_every_weight_matter(model)
    return model


@torch.no_grad()
def _make_every_weight_matter(model: torch.nn.Module) -> None:
    """Non-trivial norms and biases, and matrices 5x the usual init: with std 0.02 attention is nearly uniform,
    and a wrong rotary base or a missing transpose of a square matrix changes the logits by only ~1e-4."""
    gen = torch.Generator().manual_seed(3)
    for p in model.parameters():
        if p.dim() == 1:
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        else:
            p.mul_(5.0)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))


EXPORTS = {
    "gpt_tied": (dict(architecture="gpt", share_embeddings_and_output_weights=True), "GPT2LMHeadModel",
                 ("<|endoftext|>",)),
    "gpt_untied": (dict(architecture="gpt"), "GPT2LMHeadModel", ("<|endoftext|>", "<pad>")),
    "llama_gqa_untied": (dict(architecture="llama", num_query_groups=2, rotary_base=50000.0, layernorm_epsilon=1e-6),
                         "LlamaForCausalLM", ("<s>", "</s>", "<unk>", "<pad>")),
    "llama_tied": (dict(architecture="llama", share_embeddings_and_output_weights=True), "LlamaForCausalLM",
                   ("<s>", "</s>")),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_exported_model_matches_transformers(tmp_path, case):
    overrides, hf_class, specials = EXPORTS[case]
    tokenizer_vocab = _tokenizer(tmp_path / "tokenizer.json", specials)
    cfg = ModelConfig(vocab_size=320, **{**SMALL, **overrides})  # 320: padded above the tokenizer's size
    assert tokenizer_vocab < cfg.vocab_size
    model = _our_model(cfg)
    out = save_hf_directory(tmp_path / "hf", model.state_dict(), cfg, str(tmp_path / "tokenizer.json"))

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == hf_class
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    tied = cfg.share_embeddings_and_output_weights
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"] == ours.encode(TEXTS[0]).ids
    expected_eos = "</s>" if "</s>" in specials else "<|endoftext|>"
    assert tokenizer.eos_token == expected_eos
    assert hf.config.eos_token_id == ours.token_to_id(expected_eos)
    assert tokenizer.pad_token == ("<pad>" if "<pad>" in specials else None)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          rms_norm_eps=1e-6, tie_word_embeddings=kind == "llama_tied",
                                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    _make_every_weight_matter(model)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied"])
def test_hf_round_trip_is_lossless(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "original", safe_serialization=True)
    state, keys, tokenizer = load_hf_directory(tmp_path / "original")
    assert tokenizer is None
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size=hf.config.vocab_size)
    model = build_model(cfg).eval()
    model.load_state_dict(state, strict=True)
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff

    save_hf_directory(tmp_path / "again", state, cfg, None)
    original = load_file(tmp_path / "original/model.safetensors")
    again = load_file(tmp_path / "again/model.safetensors")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name


def test_bf16_keeps_dtype_and_bits():
    cfg = ModelConfig(architecture="llama", vocab_size=64, num_query_groups=2, **SMALL)
    state = {k: v.to(torch.bfloat16) for k, v in build_model(cfg).state_dict().items()}
    hf_state, hf_config = to_hf(state, cfg)
    assert hf_config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in hf_state.values())
    back, keys = from_hf(hf_state, hf_config)
    assert keys["num_query_groups"] == 2 and keys["make_vocab_size_divisible_by"] == 64
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_older_checkpoint_layouts():
    """OpenAI's GPT-2 files (no `transformer.` prefix, causal-mask buffers, a tied lm_head copy) and 4.x Llama
    files (rotary inv_freq buffers, top-level rope_theta) import as well."""
    cfg = ModelConfig(architecture="gpt", vocab_size=64, share_embeddings_and_output_weights=True, **SMALL)
    state = build_model(cfg).state_dict()
    hf_state, hf_config = to_hf(state, cfg)
    old = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    old |= {"h.0.attn.bias": torch.ones(1, 1, 32, 32), "lm_head.weight": old["wte.weight"].clone()}
    back, _ = from_hf(old, hf_config)
    assert all(torch.equal(back[k], state[k]) for k in state)

    cfg = ModelConfig(architecture="llama", vocab_size=64, rotary_base=5e5, **SMALL)
    state = build_model(cfg).state_dict()
    hf_state, hf_config = to_hf(state, cfg)
    assert hf_config["rope_theta"] == 5e5 and "rope_parameters" not in hf_config
    hf_state["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    back, keys = from_hf(hf_state, hf_config)
    assert keys["rotary_base"] == 5e5 and all(torch.equal(back[k], state[k]) for k in state)


def test_sharded_directory_and_pytorch_bin(tmp_path):
    cfg = ModelConfig(architecture="gpt", vocab_size=64, share_embeddings_and_output_weights=True, **SMALL)
    state = build_model(cfg).state_dict()
    out = save_hf_directory(tmp_path / "sharded", state, cfg, None, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    loaded, _, _ = load_hf_directory(out)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    transformers.AutoModelForCausalLM.from_pretrained(out)  # transformers reads our index too

    # The older format: one pickled state dict, read with weights_only.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/config.json").write_text((out / "config.json").read_text())
    torch.save(to_hf(state, cfg)[0], tmp_path / "bin/pytorch_model.bin")
    loaded, _, _ = load_hf_directory(tmp_path / "bin")
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_vocab_padding_keys_rebuild_the_same_size(tmp_path):
    """With a tokenizer, make_vocab_size_divisible_by pads its size to exactly HF's vocab_size."""
    keys = model_keys(_hf_model("gpt2").config.to_dict() | {"vocab_size": 50304}, tokenizer_vocab_size=50257)
    assert keys["make_vocab_size_divisible_by"] == 128
    assert ModelConfig.from_model_section(keys, 50257).vocab_size == 50304
    with pytest.raises(ValueError, match="vocab_size"):
        model_keys({"model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 1, "n_head": 4,
                    "n_positions": 8}, tokenizer_vocab_size=101)


GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 8}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 48,
         "num_attention_heads": 4, "max_position_embeddings": 8, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("config,key", [
    ({"model_type": "mistral"}, "model_type"),
    ({**GPT2, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**GPT2, "activation_function": "relu"}, "activation_function"),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "has no 'high_freq_factor'"),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 2.0}}, "attention_factor"),
    ({**LLAMA, "model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({**LLAMA, "model_type": "qwen3", "layer_types": ["sliding_attention"]}, "layer_types"),
    ({**LLAMA, "model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({**LLAMA, "model_type": "gemma"}, "model_type='gemma' is not supported"),
    ({**LLAMA, "attention_bias": True}, "attention_bias"),
    ({**LLAMA, "mlp_bias": True}, "mlp_bias"),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size"),
])
def test_unsupported_configs_name_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        from_hf({}, config)


def test_bad_directories_and_states_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_directory(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_hf_directory(tmp_path / "empty")

    cfg = ModelConfig(architecture="gpt", vocab_size=64, **SMALL)
    state = build_model(cfg).state_dict()
    out = save_hf_directory(tmp_path / "hf", state, cfg, None)
    with pytest.raises(ValueError, match="overwrite"):
        save_hf_directory(out, state, cfg, None)
    save_hf_directory(out, state, cfg, None, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf"]  # no temp or old directories left

    with pytest.raises(ValueError, match="layers.1.mlp.fc1.weight"):
        to_hf({k: v for k, v in state.items() if k != "layers.1.mlp.fc1.weight"}, cfg)
    with pytest.raises(ValueError, match="num_query_groups"):
        to_hf(state, ModelConfig(architecture="gpt", vocab_size=64, num_query_groups=2, **SMALL))
    hf_state, hf_config = to_hf(state, cfg)
    del hf_state["transformer.h.0.attn.c_attn.bias"]
    with pytest.raises(ValueError, match="transformer.h.0.attn.c_attn.bias"):
        from_hf(hf_state, hf_config)


def test_export_keeps_the_sources_generation_settings(tmp_path):
    """Issue 58: an export of a Hugging Face source keeps its generation_config.json (Llama 3.1 Instruct's: three
    stop ids in its order, sampling on at temperature 0.6, top_p 0.9), not the tokenizer's one eos id."""
    source = tmp_path / "source"
    source.mkdir()
    vocab = _tokenizer(source / "tokenizer.json", ("<s>", "</s>", "<|eom|>", "<|eot|>"))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    hf.save_pretrained(source, safe_serialization=True)
    (source / "generation_config.json").unlink()  # transformers' own; the source's below
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    settings = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [1, 3, 2], "temperature": 0.6,
                "top_p": 0.9, "top_k": 20, "max_length": 32}
    (source / "generation_config.json").write_text(json.dumps({**settings, "transformers_version": "4.42.3"}))
    state, keys, tokenizer = load_hf_directory(source)
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size=hf.config.vocab_size)
    out = save_hf_directory(tmp_path / "export", state, cfg, tokenizer)
    assert json.loads((out / "generation_config.json").read_text()) == settings
    loaded = transformers.GenerationConfig.from_pretrained(out)
    assert (loaded.eos_token_id, loaded.do_sample, loaded.temperature, loaded.top_p, loaded.top_k) == (
        [1, 3, 2], True, 0.6, 0.9, 20)
