# The Mixtral half of the Hugging Face converter, checked against transformers' MixtralForCausalLM: our MoE
# llama exported and loaded with AutoModelForCausalLM gives the same logits, a transformers Mixtral imported into
# ours does too, HF -> ours -> HF returns the original tensors bit for bit, and what Mixtral cannot represent is
# refused with the key named.
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runtime.convert import from_hf, load_hf_directory, model_keys, save_hf_directory, to_hf
from runtime.models import ModelConfig, build_model
from runtime.schema.model import MoEConfig
from runtime.schema.reader import Report, Section
from runtime.schema.training import parse_moe
from tests.convert.test_hf import SMALL, _ids, _make_every_weight_matter, _tokenizer

transformers = pytest.importorskip("transformers")
MOE = MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02)


def _relative_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _config(keys: dict, vocab: int) -> ModelConfig:
    """Imported keys hold model.moe as the stage YAML does (a mapping); the stage parser types it."""
    return ModelConfig.from_model_section(keys, vocab)


def test_exported_mixtral_matches_transformers(tmp_path):
    _tokenizer(tmp_path / "tokenizer.json", ("<s>", "</s>", "<unk>"))
    cfg = ModelConfig(architecture="llama", vocab_size=320, num_query_groups=2, rotary_base=50000.0,
                      layernorm_epsilon=1e-6, moe=MOE, **SMALL)
    model = build_model(cfg).eval()
    _make_every_weight_matter(model)
    out = save_hf_directory(tmp_path / "hf", model.state_dict(), cfg, str(tmp_path / "tokenizer.json"))

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["router_aux_loss_coef"]) == (4, 2, 0.02)
    assert config["output_router_logits"] is False and config["sliding_window"] is None
    names = load_file(out / "model.safetensors")
    # transformers' on-disk names, which every version loads; w1 is the gate, w3 the up projection.
    assert names["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (64, 32)
    assert names["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (32, 64)
    assert names["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 32)

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        diff = _relative_diff(model(ids), hf(ids).logits)
    assert diff <= 1e-5, diff


def _hf_mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._experts_implementation = "eager"  # the reference loop, exact in fp32
    model = transformers.MixtralForCausalLM(config)
    _make_every_weight_matter(model)
    return model.eval()


def test_imported_mixtral_matches_and_round_trips_bitwise(tmp_path):
    hf = _hf_mixtral()
    hf.save_pretrained(tmp_path / "original", safe_serialization=True)
    state, keys, _ = load_hf_directory(tmp_path / "original")
    assert keys["moe"]["num_experts"] == 4 and keys["rotary_base"] == 1e6  # Mixtral's own default theta
    cfg = _config(keys, hf.config.vocab_size)
    model = build_model(cfg).eval()
    model.load_state_dict(state, strict=True)
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        diff = _relative_diff(model(ids), hf(ids).logits)
    assert diff <= 1e-5, diff

    save_hf_directory(tmp_path / "again", state, cfg, None)
    original = load_file(tmp_path / "original/model.safetensors")
    again = load_file(tmp_path / "again/model.safetensors")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    assert model_keys(json.loads((tmp_path / "again/config.json").read_text())) == keys


def test_fused_names_import_like_the_on_disk_names(tmp_path):
    """transformers 5.x can also save its in-memory layout (mlp.experts.gate_up_proj, ...); both import alike."""
    hf = _hf_mixtral()
    hf.save_pretrained(tmp_path / "legacy")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "fused/model.safetensors")
    legacy, _, _ = load_hf_directory(tmp_path / "legacy")
    fused, _, _ = load_hf_directory(tmp_path / "fused")
    assert sorted(legacy) == sorted(fused) and all(torch.equal(legacy[k], fused[k]) for k in legacy)


def test_imported_moe_keys_parse_as_the_stage_does():
    """model.moe from config.json is a mapping the training stage's parser turns into the same MoEConfig."""
    keys = model_keys(_hf_mixtral().config.to_dict())
    report = Report()
    parsed = parse_moe(Section({"moe": keys["moe"]}, "training.model", report))
    assert not report.errors and parsed == MoEConfig(**keys["moe"])
    assert parsed == MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.001)


@pytest.mark.parametrize("change,key", [
    (dict(frequency=2), "model.moe.frequency"),
    (dict(router_activation="sigmoid"), "model.moe.router_activation"),
    (dict(normalize_top_k_affinities=False), "model.moe.normalize_top_k_affinities"),
    (dict(capacity_factor=1.25), "model.moe.capacity_factor"),
])
def test_export_refuses_what_mixtral_cannot_compute(change, key):
    moe = MoEConfig(**{**MOE.__dict__, **change})
    cfg = ModelConfig(architecture="llama", vocab_size=64, moe=moe, **SMALL)
    with pytest.raises(ValueError, match=key) as error:
        to_hf(build_model(cfg).state_dict(), cfg)
    assert "\n" not in str(error.value)


def test_router_z_loss_exports():
    """The z-loss only shapes training (as dropout does); the exported model computes the same logits."""
    cfg = ModelConfig(architecture="llama", vocab_size=64, moe=MoEConfig(num_experts=4, router_z_loss_coef=1e-3),
                      **SMALL)
    state = build_model(cfg).state_dict()
    back, keys = from_hf(*to_hf(state, cfg))
    assert keys["moe"]["router_z_loss_coef"] == 0.0 and all(torch.equal(back[k], state[k]) for k in state)


MIXTRAL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
           "intermediate_size": 48, "num_attention_heads": 4, "max_position_embeddings": 32, "num_local_experts": 4}


@pytest.mark.parametrize("config,key", [
    ({**MIXTRAL, "sliding_window": 16}, "sliding_window"),
    ({**MIXTRAL, "router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}, "num_local_experts"),
])
def test_import_refuses_what_we_do_not_compute(config, key):
    with pytest.raises(ValueError, match=key):
        from_hf({}, config)
    assert model_keys({**MIXTRAL, "sliding_window": 32})["moe"]["num_experts"] == 4  # a window >= the sequence
