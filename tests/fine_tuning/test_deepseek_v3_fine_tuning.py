"""DeepSeek-V3 through the real CLI: full SFT of a tiny DeepseekV3ForCausalLM written by transformers
(fine_tuning=hf/sft_demo: its config.json decides architecture deepseek_v3, the latent attention, YaRN with
mscale, the dense first layer and the grouped, biased, scaled experts with a shared one), 2 steps, exported in the
same command; transformers loads the export with no missing or unexpected key, and its logits are ours on the
same weights read back."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.convert import load_hf_directory
from runtime.models import ModelConfig, build_model
from tests.fine_tuning.test_fine_tuning_pipeline import _demo, _stage
from tests.launcher.helpers import nxdt

transformers = pytest.importorskip("transformers")
STEPS = ["trainer.max_steps=2", "trainer.val_check_interval=2"]


def _hf_deepseek_v3(directory, vocab: int, data):
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((data / "sft_demo" / name).read_bytes())
    return model


@pytest.mark.long("SFT of a Hugging Face DeepSeek-V3 through the CLI, exported and checked in transformers")
def test_fine_tunes_deepseek_v3_and_exports_what_transformers_loads(tmp_path):
    vocab = _demo(tmp_path / "data")
    base = _hf_deepseek_v3(tmp_path / "hf_base", vocab, tmp_path / "data")
    common = ["cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results"]
    run = nxdt(*common, "stages=[fine_tuning,conversion]", "fine_tuning=hf/sft_demo",
               *_stage("fine_tuning", f"model.restore_from_path={tmp_path}/hf_base", *STEPS), cwd=tmp_path,
               timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    exported = tmp_path / "results" / "hf_sft_demo" / "conversion" / "hf_model"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] == 24
    theirs, info = transformers.DeepseekV3ForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.config._attn_implementation = "eager"
    state, keys, _ = load_hf_directory(exported)
    ours = build_model(ModelConfig.from_model_section(keys, vocab)).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after, before = theirs.eval()(ids).logits, base(ids).logits
        torch.testing.assert_close(ours(ids), after, rtol=0, atol=1e-5)
        # the selection bias came back (a buffer, not trained here)
        assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias,
                           base.model.layers[1].mlp.gate.e_score_correction_bias)
    assert not torch.allclose(after, before, atol=1e-4), "it trained"
