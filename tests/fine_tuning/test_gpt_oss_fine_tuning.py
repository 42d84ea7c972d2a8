"""GPT-OSS through the fine-tuning stage (rendered by the real CLI, run here): full SFT of a tiny GptOssForCausalLM written by transformers
(fine_tuning=hf/sft_demo: its config.json decides architecture gpt_oss, the sliding window and layer types, YaRN,
the experts), 2 steps, exported in the same command; transformers loads the export with no missing or unexpected
key, and its logits are ours on the same weights read back. The command is rendered by the launcher (--dry-run), its
ranks forked from this process and its conversion run in it (launch_helpers.stages_here): what is under test is what
the stages compute from the family and export, the launch itself test_fine_tuning_pipeline's."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.convert import load_hf_directory
from runtime.models import ModelConfig, build_model
from tests.checkpoint.launch_helpers import stages_here
from tests.fine_tuning.test_fine_tuning_pipeline import SHORT, _demo, _stage

transformers = pytest.importorskip("transformers")
STEPS = ["trainer.max_steps=2", "trainer.val_check_interval=2"]


def _hf_gpt_oss(directory, vocab: int, data):
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        sliding_window=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    return save_with_tokenizer(transformers.GptOssForCausalLM(config).eval(), directory, data)


def save_with_tokenizer(model, directory, data):
    """`model` saved to `directory` with the SFT demo's tokenizer beside it: a Hugging Face directory to start from."""
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((data / "sft_demo" / name).read_bytes())
    return model


def fine_tune_and_export(tmp_path, make_base, model_class):
    """`make_base(directory, vocab, data)` written, fine-tuned 2 steps and exported (stages_here): transformers
    loads the export with no missing or unexpected key, its logits are ours on the weights read back, and not the
    base's. Returns the base model, the export's config.json and transformers' model of it."""
    vocab = _demo(tmp_path / "data")
    base = make_base(tmp_path / "hf_base", vocab, tmp_path / "data")
    common = ["cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results"]
    stages_here([*common, "stages=[fine_tuning,conversion]", "fine_tuning=hf/sft_demo",
                 *_stage("fine_tuning", f"model.restore_from_path={tmp_path}/hf_base", *STEPS)],
                tmp_path, tmp_path / "results" / "hf_sft_demo", "fine_tuning")
    exported = tmp_path / "results" / "hf_sft_demo" / "conversion" / "hf_model"
    config = json.loads((exported / "config.json").read_text())
    theirs, ids = loads_as_ours(exported, model_class, vocab)
    with torch.no_grad():
        assert not torch.allclose(theirs(ids).logits, base(ids).logits, atol=1e-4), "it trained"
    return base, config, theirs


def loads_as_ours(exported, model_class, vocab: int):
    """transformers loads `exported` with no missing or unexpected key, and its logits are ours on the weights read
    back. Returns its model (eager attention, eval) and the token ids compared on."""
    theirs, info = model_class.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.config._attn_implementation = "eager"
    state, keys, _ = load_hf_directory(exported)
    ours = build_model(ModelConfig.from_model_section(keys, vocab)).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs.eval()(ids).logits, rtol=0, atol=1e-5)
    return theirs, ids


@pytest.mark.long("SFT of a Hugging Face GPT-OSS (rendered by the CLI), exported and checked in transformers")
def test_fine_tunes_gpt_oss_and_exports_what_transformers_loads(tmp_path):
    base, config, _ = fine_tune_and_export(tmp_path, _hf_gpt_oss, transformers.GptOssForCausalLM)
    assert config["architectures"] == ["GptOssForCausalLM"] and config["layer_types"] == base.config.layer_types
