"""DeepSeek-V3 through the fine-tuning stages (rendered by the real CLI, run here): full SFT of a tiny DeepseekV3ForCausalLM written by transformers
(fine_tuning=hf/sft_demo: its config.json decides architecture deepseek_v3, the latent attention, YaRN with
mscale, the dense first layer and the grouped, biased, scaled experts with a shared one), 2 steps, exported in the
same command; transformers loads the export with no missing or unexpected key, and its logits are ours on the
same weights read back. LoRA (peft=hf/sft_demo) on the latent attention the same way, exported merged and as a PEFT
adapter that `peft` loads on the base. Each command is rendered by the launcher (--dry-run), its ranks forked from
this process and its conversion run in it (launch_helpers.stages_here); the refused LoRA is a real launch."""
from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint.launch_helpers import stages_here
from tests.fine_tuning.test_fine_tuning_pipeline import _demo, _stage
from tests.fine_tuning.test_gpt_oss_fine_tuning import STEPS, fine_tune_and_export, loads_as_ours, save_with_tokenizer
from tests.launcher.helpers import nxdt

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


@pytest.mark.long("SFT of a Hugging Face DeepSeek-V3 (rendered by the CLI), exported and checked in transformers")
def test_fine_tunes_deepseek_v3_and_exports_what_transformers_loads(tmp_path):
    base, config, theirs = fine_tune_and_export(tmp_path, _hf_deepseek_v3, transformers.DeepseekV3ForCausalLM)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] == 24
    # The selection bias came back as it was: no gradient reaches it.
    assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias,
                       base.model.layers[1].mlp.gate.e_score_correction_bias)


@pytest.mark.long("LoRA of a Hugging Face DeepSeek-V3 (rendered by the CLI), exported merged and as a PEFT adapter")
def test_lora_of_deepseek_v3_exports_what_transformers_and_peft_load(tmp_path):
    """peft=hf/sft_demo with the usual groups (qkv_proj, attention_dense: q_a, q_b, kv_a, kv_b and o), 2 steps,
    exported merged with base/ and adapter/ beside it in the same command: transformers loads the merged model with
    no missing or unexpected key and its logits are ours on the weights read back; `peft` on the base gives them."""
    peft_lib = pytest.importorskip("peft")
    vocab = _demo(tmp_path / "data")
    base = _hf_deepseek_v3(tmp_path / "hf_base", vocab, tmp_path / "data")
    stages_here(["cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results",
                 "stages=[peft,conversion]", "peft=hf/sft_demo", "conversion.lora=both",
                 *_stage("peft", f"model.restore_from_path={tmp_path}/hf_base",
                         "model.peft.target_modules=[qkv_proj,attention_dense]", *STEPS)],
                tmp_path, tmp_path / "results" / "hf_sft_demo_lora", "peft")
    exported = tmp_path / "results" / "hf_sft_demo_lora" / "conversion" / "hf_model"
    adapter = json.loads((exported / "adapter" / "adapter_config.json").read_text())
    assert adapter["target_modules"] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    merged, ids = loads_as_ours(exported, transformers.DeepseekV3ForCausalLM, vocab)
    adapted = peft_lib.PeftModel.from_pretrained(
        transformers.DeepseekV3ForCausalLM.from_pretrained(exported / "base"), exported / "adapter")
    for model in (adapted, base):
        model.config._attn_implementation = "eager"
    with torch.no_grad():
        after, before = merged(ids).logits, base.eval()(ids).logits
        torch.testing.assert_close(adapted.eval()(ids).logits, after, rtol=0, atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-5), "the adapters trained"


def test_lora_on_experts_refused_at_launch_in_one_line(tmp_path):
    """peft=hf/sft_demo's all_linear names the MLPs too: on DeepSeek-V3's experts, one line naming the latent
    attention's projections to adapt instead."""
    vocab = _demo(tmp_path / "data")
    _hf_deepseek_v3(tmp_path / "hf_base", vocab, tmp_path / "data")
    run = nxdt("cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results",
               "stages=[peft]", "peft=hf/sft_demo", f"peft.model.restore_from_path={tmp_path}/hf_base",
               cwd=tmp_path, timeout=300)
    assert run.returncode != 0
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "adapters on experts" in line]
    assert lines == ["error: peft.model.peft.target_modules: gate_proj, up_proj, down_proj on a mixture-of-experts "
                     "model: adapters on experts are not built; adapt the attention projections only (q_a_proj, "
                     "q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj: qkv_proj and attention_dense name them)"], \
        run.stdout[-2000:]
    assert "Traceback" not in run.stdout + run.stderr
