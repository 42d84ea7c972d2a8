"""`nxdt-launch explain-config FILE --runtime torchtitan` on NxD Training 2.26's 22 example configs
(tests/fixtures/nxdt/release_2_26, each hf_* file with the config.json of the model it names, as
test_nxdt_release.py launches them): how many the torchtitan job takes, and for each it does not the first reason.

"Maps" here: no key refused, so `training=@FILE training.runtime=torchtitan` launches; keys with no effect in the
torchtitan job (no validation, no TensorBoard, torchtitan's own initialization: launcher/titan_keys.py `named`) are
named in one line, and every file that maps names some, so none maps with nothing named."""
from __future__ import annotations

import pytest

from launcher.commands.explain_config import titan_explained
from launcher.nxdt_config import load, nxd_stage

from .helpers import nxdt
from .test_nxdt_release import CONFIG_JSON, FILES, MODELS, RELEASE

MAPS = ["hf_llama3.1_405B_trn1_config", "hf_llama3.1_70B_config", "hf_llama3.1_8B_config", "hf_llama3_70B_CP_config",
        "hf_llama3_70B_config", "hf_llama3_8B_config", "hf_llama3_8B_trn2_config", "hf_llama_7B_config", "megatron_llama_70b_config", "megatron_llama_7B_config", "megatron_mistral_config"]
MOE = "training.model.moe.num_experts: 8 with training.runtime=torchtitan: the torchtitan families here are dense"
STAGE = "torchtitan runs the training stage (pretraining) only; this file configures {}"
# The first reason of each file the torchtitan job does not take.
REFUSED = {
    "hf_llama3_70B_trn2_config": "training.model.pipeline_cuts: ['model.layers.18', 'model.layers.39', "
                                 "'model.layers.60'] with training.runtime=torchtitan: torchtitan splits the layers",
    "hf_llama3_8B_DPO_config": STAGE.format("alignment"), "hf_llama3_8B_ORPO_config": STAGE.format("alignment"),
    "hf_llama3_8B_SFT_config": STAGE.format("fine_tuning"), "hf_llama3_8B_SFT_lora_config": STAGE.format("peft"),
    "megatron_llama2_7B_SFT_config": STAGE.format("fine_tuning"),
    "hf_mixtral_8x7b_config": MOE, "hf_mixtral_8x7b_dropless_config": MOE,
    "megatron_mixtral_8x7b_config": MOE, "megatron_mixtral_8x7b_dropless_config": MOE,
    "megatron_gpt_config": "training.model.hidden_dropout: 0.1 with training.runtime=torchtitan: torchtitan's "
                           "models have no dropout",
}


def _explained(name: str):
    path = RELEASE / f"{name}.yaml"
    stage = nxd_stage(load(str(path))[0])[0]
    overrides = [f"training.model.model_config={CONFIG_JSON / MODELS[name]}.json"] if name in MODELS else []
    return titan_explained(str(path), stage, overrides)


def test_11_of_the_22_map_to_torchtitan_and_each_other_says_why_first():
    assert len(FILES) == 22 and sorted(MAPS + list(REFUSED)) == FILES
    assert len(MAPS) == 11


@pytest.mark.parametrize("name", FILES)
def test_each_release_file_through_explain_config_for_torchtitan(name):
    rows, refused, named = _explained(name)
    if name in MAPS:
        assert refused == [] and named and rows
        assert any(key == "training.model.hidden_size" and "model.dim = " in fate for key, _, fate in rows)
    else:
        assert refused and REFUSED[name] in refused[0], refused


def test_the_cli_prints_the_torchtitan_table_and_refuses_in_one_line(tmp_path):
    model_config = f"training.model.model_config={CONFIG_JSON / 'llama3_8b.json'}"
    result = nxdt("explain-config", str(RELEASE / "hf_llama3_8B_config.yaml"), "--runtime", "torchtitan",
                  model_config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.replace("│", " ").split())
    for row in ("training.model.tensor_model_parallel_size 32 parallelism.tensor_parallel_degree = 32",
                "training.model.optim.sched.warmup_steps 100 lr_scheduler.warmup_steps = 101",
                "no effect in the torchtitan job: trainer.val_check_interval",
                "launch it with: nxdt-launch training=@"):
        assert row in flat, row
    mixtral = nxdt("explain-config", str(RELEASE / "hf_mixtral_8x7b_config.yaml"), "--runtime", "torchtitan",
                   f"training.model.model_config={CONFIG_JSON / 'mixtral_8x7b.json'}", cwd=tmp_path)
    assert mixtral.returncode == 2 and "Traceback" not in mixtral.stderr
    assert mixtral.stderr.strip().splitlines()[0].startswith(f"error: {MOE}"), mixtral.stderr
