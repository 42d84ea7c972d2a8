"""DeepSeek-V3 through the real CLI: full SFT of a tiny DeepseekV3ForCausalLM written by transformers
(fine_tuning=hf/sft_demo: its config.json decides architecture deepseek_v3, the latent attention, YaRN with
mscale, the dense first layer and the grouped, biased, scaled experts with a shared one), 2 steps, exported in the
same command; transformers loads the export with no missing or unexpected key, and its logits are ours on the
same weights read back."""
from __future__ import annotations

import pytest
import torch

from tests.fine_tuning.test_gpt_oss_fine_tuning import fine_tune_and_export, save_with_tokenizer

transformers = pytest.importorskip("transformers")


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
    return save_with_tokenizer(model, directory, data)


@pytest.mark.long("SFT of a Hugging Face DeepSeek-V3 through the CLI, exported and checked in transformers")
def test_fine_tunes_deepseek_v3_and_exports_what_transformers_loads(tmp_path):
    base, config, theirs = fine_tune_and_export(tmp_path, _hf_deepseek_v3, transformers.DeepseekV3ForCausalLM)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] == 24
    # The selection bias came back as it was: no gradient reaches it.
    assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias,
                       base.model.layers[1].mlp.gate.e_score_correction_bias)


def test_lora_refused_at_launch_in_one_line(tmp_path):
    from tests.fine_tuning.test_fine_tuning_pipeline import _demo
    from tests.launcher.helpers import nxdt

    vocab = _demo(tmp_path / "data")
    _hf_deepseek_v3(tmp_path / "hf_base", vocab, tmp_path / "data")
    run = nxdt("cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results",
               "stages=[peft]", "peft=hf/sft_demo", f"peft.model.restore_from_path={tmp_path}/hf_base",
               cwd=tmp_path, timeout=300)
    assert run.returncode != 0
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "LoRA on multi-head latent attention" in line]
    assert len(lines) == 1 and "peft.model.peft: LoRA on multi-head latent attention" in lines[0], run.stdout[-2000:]
    assert "Traceback" not in run.stdout + run.stderr
