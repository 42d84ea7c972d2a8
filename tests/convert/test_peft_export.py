# Exporting a LoRA run, checked against transformers and peft themselves: the merged model and the base + PEFT
# adapter both compute our adapted model's logits, from tensors and through the conversion stage on a checkpoint
# that holds only the adapters (as a LoRA run's does), with its base from model.restore_from_path.
from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from runtime.checkpoint import write_full_checkpoint
from runtime.convert import load_hf_directory, save_hf_directory
from runtime.convert.__main__ import PROVENANCE, main
from runtime.convert.peft import save_adapter, to_peft
from runtime.models import ModelConfig, build_model
from runtime.models.lora import apply_lora, is_adapter, merge_lora
from runtime.schema.choices import LORA_MODULES
from runtime.schema.training_config import LoraConfig
from tests.convert.test_hf import SMALL, _ids, _make_every_weight_matter, _tokenizer

transformers = pytest.importorskip("transformers")
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=LORA_MODULES)
PEFT_SECTION = {"peft_scheme": "lora", "lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
                "target_modules": ["all_linear"]}
TOLERANCE = 1e-5


def with_random_adapters(model, lora: LoraConfig) -> None:
    """`lora`'s adapters on `model`, every one random: B starts at zero, and random adapters make every segment's
    delta matter."""
    apply_lora(model, lora, seed=0)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


@pytest.fixture
def run(tmp_path):
    """A tiny GQA Llama (vocab padded from the tokenizer as the runtime pads it) with non-zero adapters on all
    seven targets, its base as a Hugging Face directory, and the `model:` keys that rebuild it."""
    tokenizer = tmp_path / "tokenizer.json"
    size = _tokenizer(tokenizer, ("<s>", "</s>"))
    keys = {"architecture": "llama", "num_query_groups": 2, "rotary_base": 50000.0, "layernorm_epsilon": 1e-6,
            "make_vocab_size_divisible_by": 64, **SMALL}
    cfg = ModelConfig.from_model_section(keys, size)
    model = build_model(cfg).eval()
    _make_every_weight_matter(model)
    base = {n: t.clone() for n, t in model.state_dict().items()}
    with_random_adapters(model, LORA)
    save_hf_directory(tmp_path / "base_hf", base, cfg, str(tokenizer))
    _, hf_keys, _ = load_hf_directory(tmp_path / "base_hf")
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    return dict(cfg=cfg, model=model, base=base, trained=trained, tokenizer=str(tokenizer), keys=hf_keys)


def _logits(model, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(_ids(vocab))
    return getattr(out, "logits", out)


def _diff(ours, theirs, vocab: int) -> float:
    return (_logits(ours, vocab) - _logits(theirs, vocab)).abs().max().item()


def _hf(directory):
    return transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()


def _peft(base_dir, adapter_dir):
    import peft  # here, not at collection: its import loads a dozen transformers models (~5 s on every worker)

    return peft.PeftModel.from_pretrained(_hf(base_dir), adapter_dir).eval()


def test_merged_and_peft_exports_match_our_lora_model(tmp_path, run):
    cfg, model = run["cfg"], run["model"]
    merged = merge_lora(model.state_dict(), cfg, LORA.scale)
    save_hf_directory(tmp_path / "merged", merged, cfg, run["tokenizer"])
    assert _diff(model, _hf(tmp_path / "merged"), cfg.vocab_size) <= TOLERANCE

    state, config = to_peft(model.state_dict(), cfg, LORA, base_model_name_or_path=str(tmp_path / "base_hf"))
    assert len(state) == 2 * 7 * cfg.num_layers
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in state
    assert state["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, cfg.ffn_hidden_size)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["target_modules"] == sorted(LORA_MODULES)
    save_adapter(tmp_path / "adapter", state, config)
    adapted = _peft(tmp_path / "base_hf", tmp_path / "adapter")
    assert _diff(model, adapted, cfg.vocab_size) <= TOLERANCE
    base_only = _hf(tmp_path / "base_hf")  # the adapters do change the logits
    assert _diff(model, base_only, cfg.vocab_size) > 1e-2


def _checkpoint(tmp_path, run, restore_from: str | None, name: str = "lora_ckpt") -> str:
    """A checkpoint as a LoRA run writes it: the adapters only, and the training-shaped config."""
    model = {**run["keys"], "tokenizer": {"library": "huggingface", "model": run["tokenizer"]},
             "peft": PEFT_SECTION, "restore_from_path": restore_from}
    write_full_checkpoint(str(tmp_path / name), 20, run["trained"], config={"model": model})
    return str(tmp_path / name)


def _convert(tmp_path, capsys, **conversion) -> tuple[int, list[str]]:
    path = tmp_path / "conversion_config.yaml"
    path.write_text(yaml.safe_dump({"mode": "export", **conversion}))
    code = main(["--config", str(path)])
    captured = capsys.readouterr()
    return code, (captured.err.strip().splitlines() if code else captured.out.splitlines())


@pytest.mark.parametrize("restore", ["hf", "checkpoint"])
def test_the_stage_exports_a_lora_checkpoint(tmp_path, run, capsys, restore):
    cfg, model = run["cfg"], run["model"]
    if restore == "hf":
        base = str(tmp_path / "base_hf")
    else:  # the base as a checkpoint of ours (e.g. a pretraining run's)
        base = write_full_checkpoint(str(tmp_path / "base_ckpt"), 100, run["base"],
                                     config={"model": {**run["keys"], "tokenizer": {"model": run["tokenizer"]}}})
    checkpoint = _checkpoint(tmp_path, run, base)
    out = tmp_path / "out"
    settings = dict(checkpoint_dir=checkpoint, output_dir=str(out))

    code, said = _convert(tmp_path, capsys, **settings)  # conversion.lora defaults to merged
    assert code == 0, said
    assert _diff(model, _hf(out), cfg.vocab_size) <= TOLERANCE
    assert not (out / "adapter").exists()
    assert json.loads((out / PROVENANCE).read_text())["lora"] == "merged"
    code, said = _convert(tmp_path, capsys, **settings)  # the same checkpoint and settings again
    assert code == 0 and any("nothing to do" in line for line in said), said

    code, said = _convert(tmp_path, capsys, **settings, lora="adapter")  # a new setting: exported again
    assert code == 0 and any("replacing the export of" in line for line in said), said
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(out) and adapter["peft_type"] == "LORA"
    assert _diff(model, _hf(out), cfg.vocab_size) > 1e-2  # output_dir is the base itself
    assert _diff(model, _peft(adapter["base_model_name_or_path"], out / "adapter"), cfg.vocab_size) <= TOLERANCE

    code, said = _convert(tmp_path, capsys, **settings, lora="both")
    assert code == 0, said
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(out / "base")
    assert _diff(model, _hf(out), cfg.vocab_size) <= TOLERANCE
    assert _diff(model, _peft(out / "base", out / "adapter"), cfg.vocab_size) <= TOLERANCE


def test_a_lora_run_from_random_init_exports_on_its_seeds_base(tmp_path, run, capsys):
    """No restore_from_path: the frozen base was the random init of model.seed, which the export rebuilds."""
    cfg = run["cfg"]
    seeded = build_model(cfg).eval()
    apply_lora(seeded, LORA, seed=0)
    seeded.load_state_dict(run["trained"], strict=False)
    out = tmp_path / "out"
    code, said = _convert(tmp_path, capsys, checkpoint_dir=_checkpoint(tmp_path, run, None, "no_base"),
                          output_dir=str(out))
    assert code == 0, said
    assert _diff(seeded, _hf(out), cfg.vocab_size) <= TOLERANCE
    assert _diff(run["model"], _hf(out), cfg.vocab_size) > 1e-2  # not the fixture's own (scaled) base


def test_adapter_moments_go_with_the_adapter(tmp_path, run, capsys, monkeypatch):
    import runtime.convert.__main__ as stage

    real = stage.read_rank_files

    def with_moments(*args, **kwargs):  # a LoRA run's rank file holds its adapters' Adam moments too
        files = real(*args, **kwargs)
        files[0]["optim"] = {n: [{"dim": None, "index": None, "full_shape": tuple(t.shape), "start": 0,
                                  "shard_shape": tuple(t.shape), "exp_avg": t * 2, "exp_avg_sq": t * t}]
                             for n, t in run["trained"].items()}
        return files

    monkeypatch.setattr(stage, "read_rank_files", with_moments)
    out = tmp_path / "out"
    code, said = _convert(tmp_path, capsys, checkpoint_dir=_checkpoint(tmp_path, run, str(tmp_path / "base_hf")),
                          output_dir=str(out), lora="adapter", include_optimizer=True)
    assert code == 0, said
    exp_avg = load_file(out / "adapter" / "optimizer" / "exp_avg.safetensors")
    name = "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"
    assert len(exp_avg) == 2 * 7 * run["cfg"].num_layers
    assert torch.equal(exp_avg[name], 2 * run["trained"]["layers.1.mlp.gate_up.lora.B.gate_proj"])


def test_bad_inputs_name_the_key(tmp_path, run, capsys):
    out = str(tmp_path / "out")
    cases = [  # (checkpoint, conversion settings, words the one error line holds)
        (_checkpoint(tmp_path, run, str(tmp_path / "gone"), "gone_base"), {}, ["model.restore_from_path", "gone"]),
        (_checkpoint(tmp_path, run, str(tmp_path / "base_hf"), "opt"), {"include_optimizer": True},
         ["conversion.include_optimizer", "conversion.lora=adapter"]),
        (_checkpoint(tmp_path, run, str(tmp_path / "base_hf"), "rank"), {"lora": "bogus"},
         ["conversion.lora", "merged, adapter, both"]),
    ]
    full = write_full_checkpoint(str(tmp_path / "full"), 5, run["base"], config={"model": {
        **run["keys"], "tokenizer": {"model": run["tokenizer"]}}})
    cases.append((full, {"lora": "adapter"}, ["conversion.lora=adapter", "not a LoRA run", "conversion.lora=merged"]))
    for checkpoint, settings, words in cases:
        code, said = _convert(tmp_path, capsys, checkpoint_dir=checkpoint, output_dir=out, **settings)
        assert code == 2 and len(said) == 1, (settings, said)
        assert all(word in said[0] for word in words), said
    assert not (tmp_path / "out").exists()


def test_adapters_must_match_the_config_and_gpt_is_merged_only(run):
    cfg, trained = run["cfg"], run["trained"]
    with pytest.raises(ValueError, match=r"missing \['layers.0.attn.qkv.lora.A.q_proj'"):
        to_peft({n: t for n, t in trained.items() if "q_proj" not in n}, cfg, LORA)
    with pytest.raises(ValueError, match=r"has shape \(4, 32\); model.peft and the model keys make \(8, 32\)"):
        to_peft(trained, cfg, LoraConfig(rank=8, alpha=8.0, dropout=0.0, target_modules=LORA_MODULES))
    gpt = ModelConfig(architecture="gpt", vocab_size=64, **SMALL)
    with pytest.raises(ValueError, match="conversion.lora=merged"):
        to_peft({}, gpt, LORA)
