"""Gemma 3 through the fine-tuning stage end to end (rendered by the real CLI, run here): a tiny Gemma3ForCausalLM written by transformers
(sliding-window layers with a window shorter than the rows, sandwich norms, GeGLU, a tied head) fine-tuned 2 steps
by fine_tuning=hf/sft_demo and exported in the same command: transformers loads the export with no missing or
unexpected key, and its logits are ours for the same weights. Then LoRA (peft=hf/sft_demo) from the same directory,
exported merged and as a PEFT adapter: `peft` on the base gives the merged model's logits. Each command is rendered by the launcher (--dry-run),
its ranks forked from this process and its conversion run in it (launch_helpers.stages_here): what is under test is
what the stages compute from a Gemma 3 and export, the launch itself test_fine_tuning_pipeline's."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime.convert import load_hf_directory
from runtime.models import ModelConfig, build_model
from tests.checkpoint.launch_helpers import stages_here
from tests.fine_tuning.test_fine_tuning_pipeline import SHORT, _demo

transformers = pytest.importorskip("transformers")


@pytest.mark.long("2 steps of SFT and of LoRA from a Hugging Face Gemma 3, exported and checked in transformers")
def test_fine_tunes_a_hugging_face_gemma3_and_exports_it(tmp_path):
    vocab = _demo(tmp_path / "data")
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=16, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_local_base_freq=10000.0,
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0})
    base = transformers.Gemma3ForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "hf_base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tmp_path / "data" / "sft_demo" / name, tmp_path / "hf_base" / name)

    short = [o for o in SHORT if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    stages_here(["cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results",
                 "stages=[fine_tuning,conversion]", "fine_tuning=hf/sft_demo",
                 *[f"fine_tuning.{o}" for o in [*short, "trainer.max_steps=2", "trainer.val_check_interval=2",
                                                  f"model.restore_from_path={tmp_path}/hf_base"]]],
                tmp_path, tmp_path / "results" / "hf_sft_demo", "fine_tuning")
    exported = tmp_path / "results" / "hf_sft_demo" / "conversion" / "hf_model"
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]

    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state, keys, _ = load_hf_directory(exported)
    ours = build_model(ModelConfig.from_model_section(keys, theirs.config.vocab_size)).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(0))  # past the 16-token window
    with torch.no_grad():
        after, before = theirs.eval()(ids).logits, base(ids).logits
        torch.testing.assert_close(ours(ids), after, rtol=0, atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-4), "it trained"

    # LoRA from the same Hugging Face directory, exported merged and as a PEFT adapter that `peft` loads on the base.
    peft_lib = pytest.importorskip("peft")
    stages_here(["cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results",
                 "stages=[peft,conversion]", "peft=hf/sft_demo", "conversion.lora=both",
                 *[f"peft.{o}" for o in [*short, "trainer.max_steps=2", "trainer.val_check_interval=2",
                                          f"model.restore_from_path={tmp_path}/hf_base"]]],
                tmp_path, tmp_path / "results" / "hf_sft_demo_lora", "peft")
    merged_dir = tmp_path / "results" / "hf_sft_demo_lora" / "conversion" / "hf_model"
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()(ids).logits
        adapted = peft_lib.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(merged_dir / "base"), merged_dir / "adapter").eval()(ids)
    torch.testing.assert_close(adapted.logits, merged, rtol=0, atol=1e-5)
    assert not torch.allclose(merged, before, atol=1e-5), "the adapters trained"
