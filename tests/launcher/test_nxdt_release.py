"""Every example config of NxD Training's last release here (2.26.0: examples/conf of
github.com/aws-neuron/neuronx-distributed-training at 9169aa0, the 22 files copied unedited into
tests/fixtures/nxdt/release_2_26) goes through the dry run of the stage it configures, unchanged, with a
config.json of the model it names: each renders the file's own layout, checked key by key against the file."""
from __future__ import annotations

import pytest

from launcher import launch
from launcher.errors import UserError
from launcher.nxdt_config import load, nxd_stage

from .helpers import REPO

RELEASE = REPO / "tests" / "fixtures" / "nxdt" / "release_2_26"
CONFIG_JSON = RELEASE / "config_json"
# The Hugging Face config.json each hf_* file's model_config names (/home/ubuntu/config.json in every file): the
# model its name says, as published. hf_llama_7B_config trains a 4-layer cut of Llama 2 7B (its num_layers: 4, which
# NxD Training applies over config.json's 32).
MODELS = {
    "hf_llama3.1_405B_trn1_config": "llama3.1_405b", "hf_llama3.1_70B_config": "llama3.1_70b",
    "hf_llama3.1_8B_config": "llama3.1_8b", "hf_llama3_70B_CP_config": "llama3_70b",
    "hf_llama3_70B_config": "llama3_70b", "hf_llama3_70B_trn2_config": "llama3_70b",
    "hf_llama3_8B_DPO_config": "llama3_8b", "hf_llama3_8B_ORPO_config": "llama3_8b",
    "hf_llama3_8B_SFT_config": "llama3_8b", "hf_llama3_8B_SFT_lora_config": "llama3_8b",
    "hf_llama3_8B_config": "llama3_8b", "hf_llama3_8B_trn2_config": "llama3_8b",
    "hf_llama_7B_config": "llama2_7b", "hf_mixtral_8x7b_config": "mixtral_8x7b",
    "hf_mixtral_8x7b_dropless_config": "mixtral_8x7b",
}
FILES = sorted(path.stem for path in RELEASE.glob("*.yaml"))
# Files this release of nxdt-launch refuses, each with the one line it says: none. LoRA on k and v above the KV
# heads (hf_llama3_8B_SFT_lora_config, kv_replicator 4) and dropout inside the MLP (megatron_gpt_config's
# ffn_dropout 0.1) are built; the GPT file's schedule (80000 constant steps in its 20000) holds min_lr after the
# warmup, as NeMo's CosineAnnealing does, with a warning.
REFUSED: dict[str, str] = {}


def _get(data: dict, dotted: str, default=None):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _file_layout(raw: dict) -> dict:
    """The layout the file states, by its own keys (NxD puts parallelism under distributed_strategy; absent
    keys are NxD's defaults)."""
    strategy = raw.get("distributed_strategy") or {}
    return {
        "num_nodes": _get(raw, "trainer.num_nodes"), "devices": _get(raw, "trainer.devices"),
        "tp": strategy.get("tensor_model_parallel_size", 1), "pp": strategy.get("pipeline_model_parallel_size", 1),
        "vpp": strategy.get("virtual_pipeline_model_parallel_size", 1) or 1,
        "cp": strategy.get("context_parallel_size", 1), "ep": strategy.get("expert_model_parallel_size", 1),
        "sp": bool(strategy.get("sequence_parallel", False)), "zero1": bool(strategy.get("zero1", False)),
        "seq": _get(raw, "data.seq_length"), "gbs": _get(raw, "data.global_batch_size"),
        "mbs": _get(raw, "data.micro_batch_size"), "max_steps": _get(raw, "trainer.max_steps"),
        "precision": _get(raw, "precision.type"),
        "recompute": _get(raw, "model.activations_checkpoint_granularity"),
    }


def _our_layout(stage_cfg: dict) -> dict:
    model = stage_cfg["model"]
    return {
        "num_nodes": stage_cfg["trainer"]["num_nodes"], "devices": stage_cfg["trainer"]["devices"],
        "tp": model.get("tensor_model_parallel_size", 1), "pp": model.get("pipeline_model_parallel_size", 1),
        "vpp": model.get("virtual_pipeline_model_parallel_size") or 1, "cp": model.get("context_parallel_size", 1),
        "ep": model.get("expert_model_parallel_size", 1), "sp": bool(model.get("sequence_parallel")),
        "zero1": bool(model.get("zero1")), "seq": model["data"].get("seq_length", model.get("encoder_seq_length")),
        "gbs": model["global_batch_size"], "mbs": model["micro_batch_size"],
        "max_steps": stage_cfg["trainer"]["max_steps"], "precision": stage_cfg["precision"]["type"],
        "recompute": model.get("activations_checkpoint_granularity"),
    }


def _plan(name: str, tmp_path):
    path = RELEASE / f"{name}.yaml"
    stage = nxd_stage(load(str(path))[0])[0]
    cluster = "pcluster_trn2" if "trn2" in name else "pcluster_trn1"
    overrides = [f"stages=[{stage}]", f"{stage}=@{path}", f"cluster={cluster}", "cluster_type=slurm",
                 "data_dir=/data", f"base_results_dir={tmp_path}"]
    if name in MODELS:
        overrides.append(f"{stage}.model.model_config={CONFIG_JSON / MODELS[name]}.json")
    return stage, launch.make_plan(overrides, dry_run=True, produced_by="test")


@pytest.mark.parametrize("name", FILES)
def test_each_release_file_renders_its_own_layout_or_is_refused_in_one_line(name, tmp_path):
    if name in REFUSED:
        with pytest.raises(UserError) as refused:
            _plan(name, tmp_path)
        assert REFUSED[name] in str(refused.value)
        return
    stage, plan = _plan(name, tmp_path)
    raw = load(str(RELEASE / f"{name}.yaml"))[0]  # its interpolations resolved, as NxD Training reads it
    want, got = _file_layout(raw), _our_layout(plan.cfg[stage])
    for key, value in want.items():
        if value is not None:
            assert got[key] == value, (key, got[key], value)


def test_all_22_of_the_release_run():
    assert len(FILES) == 22 and REFUSED == {}


def test_the_megatron_gpt_schedule_holds_min_lr_after_warmup_as_nemo_does(tmp_path):
    """750 warmup + 80000 constant steps in 20000: NeMo's CosineAnnealing (decay length negative) holds min_lr from
    the end of the warmup; the dry run says so and the schedule the runtime builds does it."""
    from runtime.optim_schedule import LRSchedule

    stage, plan = _plan("megatron_gpt_config", tmp_path)
    said = [w for w in plan.warnings if "constant_steps 80000" in w]
    assert len(said) == 1 and said[0].endswith(
        "training.model.optim.sched.constant_steps: warmup_steps 750 + constant_steps 80000 exceeds trainer.max_steps "
        "20000: as in NeMo, the learning rate holds min_lr from step 751 to the end, with no decay; lower "
        "constant_steps to 19250 or less to decay"), plan.warnings
    sched = plan.cfg[stage]["model"]["optim"]["sched"]
    lr = plan.cfg[stage]["model"]["optim"]["lr"]
    schedule = LRSchedule(sched["name"], lr=lr, max_steps=20000, warmup_steps=750, constant_steps=80000,
                          min_lr=sched["min_lr"])
    assert schedule(750) == lr and schedule(751) == schedule(19999) == sched["min_lr"] < lr


def test_the_trn2_file_keeps_its_logical_cores_and_uneven_stages(tmp_path):
    """hf_llama3_70B_trn2_config: LNC 2 (64 workers per trn2.48xlarge) and pipeline_cuts after layers 18, 39 and 60
    of 80, which the schema reads as the stages' last layers (19, 21, 21 and 19 layers)."""
    from runtime.schema import rules
    from runtime.schema.training import parse_training

    stage, plan = _plan("hf_llama3_70B_trn2_config", tmp_path)
    assert plan.cfg["cluster"]["neuron"]["lnc"] == 2 and plan.cfg[stage]["trainer"]["devices"] == 64
    parsed, report = parse_training(plan.cfg[stage], files="warn")
    assert parsed is not None, report.errors
    cuts = parsed.parallel.pipeline_cuts
    assert cuts == (18, 39, 60) and [len(r) for r in rules.stage_layers(80, 4, cuts)] == [19, 21, 21, 19]
    assert any("LlamaRMSNorm: norms are kept, not recomputed" in w for w in plan.warnings)


def test_hf_llama_7B_trains_the_4_layer_cut_of_llama_2_7b_that_nxd_trains(tmp_path):
    """NxD Training builds the model from config.json and applies the YAML's num_layers, hidden_size and rope_theta
    over it: with Llama 2 7B's published config.json (32 layers) the file's num_layers: 4 wins, and the dry run
    says so. The other keys stay config.json's."""
    from runtime.schema.training import parse_training

    stage, plan = _plan("hf_llama_7B_config", tmp_path)
    assert plan.cfg[stage]["model"]["model_config_overrides"] == {"num_layers": 4, "hidden_size": 4096}
    parsed, report = parse_training(plan.cfg[stage], files="warn")
    assert parsed is not None, report.errors
    model = parsed.model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads) == (4, 4096, 11008,
                                                                                                      32)
    said = [w for w in plan.warnings if "model_config_overrides" in w]
    assert len(said) == 1 and said[0].endswith(
        f"training.model.model_config_overrides.num_layers: 4 replaces config.json's 32 "
        f"({CONFIG_JSON / 'llama2_7b.json'}), as NxD Training applies its YAML's model keys over config.json"), said


def test_outside_an_nxd_file_a_key_against_config_json_is_still_refused_and_overrides_are_checked(tmp_path):
    """model.model_config_overrides is how an NxD file's explicit keys win; the same key written plainly (our recipes
    against a user's config.json) stays a refused contradiction, and the overrides themselves are checked."""
    import copy

    from runtime.schema.training import parse_training

    stage, plan = _plan("hf_llama_7B_config", tmp_path)

    def errors(**model):
        cfg = copy.deepcopy(plan.cfg[stage])
        cfg["model"].update(model)
        parsed, report = parse_training(cfg, files="warn")
        assert (parsed is None) == bool(report.errors)
        return report.errors

    assert errors(model_config_overrides=None, num_layers=4)[0].startswith(
        "training.model.num_layers: the YAML disagrees with ")
    assert errors(model_config_overrides={"nums_layers": 4}) == [
        "training.model.model_config_overrides.nums_layers: not a key that can be set over config.json; did you "
        "mean 'num_layers'? valid keys here: num_layers, hidden_size, rotary_base"]
    assert errors(model_config_overrides={"num_layers": 0}) == [
        "training.model.model_config_overrides.num_layers: 0 must be a positive integer"]
    assert errors(model_config=None, model_config_overrides={"num_layers": 4})[0] == (
        "training.model.model_config_overrides: there is no config.json to override (model.model_config is not set); "
        "set the model's keys themselves (model.num_layers)")
