"""The alignment stage (DPO, ORPO) in the launcher: it composes, validates with the training schema under its own
name, renders the trainer's job with --stage alignment, chains after data_preparation and fine_tuning, makes the
launch's conversion and evaluation follow it, and every recipe renders for its target in a dry run. NxD Training's
DPO and ORPO files run as the stage. Mistakes are one `error:` line each, exit code 2, nothing written. The schema's
own rules (kl_beta, prompt limits, references without LoRA, ...) are tested with the schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from launcher import launch
from launcher.errors import UserError
from launcher.estimator import estimate
from launcher.paths import group_choices
from launcher.stages import STAGES
from runtime.schema.training import parse_training
from tests.estimate.host_fit import host_memory_problems
from tests.recipe_data import write_hf_weights, write_tokenizer

from .helpers import nxdt, resolved
from .test_fine_tuning_stages import FIXTURES, LLAMA3_8B, _one_error_line, _sft_demo_files

GIB = 2**30
DPO_FILE = FIXTURES / "hf_llama3_8B_DPO_config.yaml"
ORPO_FILE = FIXTURES / "hf_llama3_8B_ORPO_config.yaml"
SFT_FILE = FIXTURES / "hf_llama3_8B_SFT_config.yaml"
PAIR = {"prompt": "add: 1 + 2", "chosen": "3", "rejected": "4"}


def _plan(tmp_path: Path, *overrides: str, dry_run: bool = True, data_dir: Path | None = None) -> launch.Plan:
    return launch.make_plan([f"base_results_dir={tmp_path / 'results'}", f"data_dir={data_dir or tmp_path / 'data'}",
                             "cluster_type=slurm", *overrides], dry_run=dry_run, produced_by="test")


def _preference_demo_files(data: Path) -> None:
    """What data_preparation=preference_demo writes, as far as the launch looks at it."""
    folder = data / "preference_demo"
    folder.mkdir(parents=True)
    write_tokenizer(folder / "tokenizer.json", 512)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    for split in ("train", "valid", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps(PAIR) + "\n")


def test_the_stage_sits_between_peft_and_conversion_and_the_default_pipeline_is_unchanged():
    # The reward model (rlhf_rm) trains on the same pairs, after alignment.
    assert STAGES.index("alignment") == STAGES.index("peft") + 1 == STAGES.index("rlhf_rm") - 1
    # GRPO (rl) after the reward model, before conversion.
    assert STAGES.index("rlhf_rm") == STAGES.index("rl") - 1 == STAGES.index("conversion") - 2
    cfg = resolved()
    assert cfg["stages"] == ["data_preparation", "training", "conversion", "evaluation"]
    assert cfg["alignment"]["run"]["name"] == "llama_tiny_dpo" and cfg["alignment"]["strategy"] == "dpo"
    assert group_choices("alignment") == ["llama/tiny_dpo", "llama/tiny_orpo", "llama3/8b", "llama3/8b_gpu",
                                          "llama3/8b_lora", "llama3/8b_trn2"]


@pytest.mark.parametrize("recipe,strategy", [("llama/tiny_dpo", "dpo"), ("llama/tiny_orpo", "orpo")])
def test_alignment_renders_the_trainer_with_its_stage(recipe, strategy, tmp_path):
    plan = _plan(tmp_path, "stages=[alignment]", f"alignment={recipe}")
    (script,) = launch.write(plan)
    text = script.read_text()
    run = f"llama_tiny_{strategy}"  # run_name: the stage's own run
    config = plan.jobs[0].config_path  # the launch's own (launches/<id>/), which alignment_config.yaml links to
    assert (tmp_path / "results" / run / "alignment" / "alignment_config.yaml").resolve() == config.resolve()
    assert f"-m runtime.train --config {config} --stage alignment" in text
    # The trainer's job: torchrun over the stage's nodes, SIGUSR1 before the limit, requeue.
    assert "--nproc_per_node 2" in text and "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    assert "alignment.run.max_restarts is $MAX_RESTARTS" in text
    written = yaml.safe_load(config.read_text())
    assert written["strategy"] == strategy and list(written["model_alignment_strategy"]) == [strategy]
    data = written["model"]["data"]
    assert data["train_ds"]["file_names"] == [f"{tmp_path}/data/preference_demo/train.jsonl"]
    assert data["validation_ds"]["file_names"] == [f"{tmp_path}/data/preference_demo/valid.jsonl"]
    assert "packing" not in data and data["data_prefix"] is None  # pairs are never packed
    # 256 validation pairs: limit_val_batches global batches of global_batch_size pairs.
    assert written["trainer"]["limit_val_batches"] * written["model"]["global_batch_size"] == 256
    assert written["model"]["restore_from_path"] is None and written["model"].get("peft") is None
    # The files are not there: warnings in a dry run, named by the stage's own keys.
    assert f"alignment.model.data.train_ds.file_names: {tmp_path}/data/preference_demo/train.jsonl does not exist" \
        in " ".join(plan.warnings)


def test_the_written_stage_config_is_what_the_trainer_reads(tmp_path):
    data = tmp_path / "data"
    _preference_demo_files(data)
    for recipe in ("llama/tiny_dpo", "llama/tiny_orpo"):
        plan = _plan(tmp_path, "stages=[alignment]", f"alignment={recipe}", dry_run=False)
        launch.write(plan)
        written = yaml.safe_load(plan.jobs[0].config_path.read_text())
        cfg, report = parse_training(written, files="error", p="alignment.")
        assert report.errors == [] and cfg is not None, report.errors
        assert cfg.alignment.strategy == recipe.rsplit("_", 1)[1] and cfg.alignment.beta == 0.1
        assert cfg.alignment.max_prompt_length == 64 and cfg.alignment.truncation_mode == "keep_start"
        assert cfg.sft.train_files == (f"{data}/preference_demo/train.jsonl",) and not cfg.sft.packing
        assert cfg.model.vocab_size == 512 and cfg.lora is None


def test_conversion_and_evaluation_follow_the_aligned_model():
    cfg = resolved("stages=[alignment,conversion,evaluation]")
    alignment = cfg["alignment"]
    assert cfg["run_name"] == "llama_tiny_dpo"
    assert alignment["run"]["results_dir"] == "/results/llama_tiny_dpo/alignment"
    assert cfg["conversion"]["checkpoint_dir"] == cfg["evaluation"]["checkpoint_dir"] == \
        "/results/llama_tiny_dpo/alignment/checkpoints"
    assert cfg["conversion"]["tokenizer_model"] == alignment["model"]["tokenizer"]["model"]
    assert cfg["conversion"]["run"]["name"] == "convert_llama_tiny_dpo"
    assert cfg["evaluation"]["trainer"]["accelerator"] == alignment["trainer"]["accelerator"]
    # The last trainer stage of the launch names the run and is what is converted: SFT then DPO exports the
    # aligned model.
    chained = resolved("stages=[fine_tuning,alignment,conversion]")
    assert chained["run_name"] == "llama_tiny_dpo"
    assert chained["conversion"]["checkpoint_dir"] == "/results/llama_tiny_dpo/alignment/checkpoints"
    assert chained["fine_tuning"]["run"]["results_dir"] == "/results/llama_tiny_dpo/fine_tuning"


def test_a_lora_alignment_is_converted_from_its_own_checkpoints(tmp_path):
    """The conversion stage rebuilds a LoRA run from its checkpoint's config.yaml (model.peft + restore_from_path),
    whichever stage wrote it: the launch points it at the alignment's checkpoints."""
    plan = _plan(tmp_path, "stages=[alignment,conversion]", "alignment=llama3/8b_lora", "cluster=pcluster_trn1",
                 "conversion.lora=both", data_dir=Path("/data"))
    alignment, conversion = plan.jobs
    assert conversion.dependency == "afterok"
    assert conversion.stage_config["checkpoint_dir"] == f"{alignment.results_dir}/checkpoints"
    assert conversion.stage_config["lora"] == "both"
    model = alignment.stage_config["model"]
    assert model["peft"]["peft_scheme"] == "lora" and model["restore_from_path"] == "/data/hf/Meta-Llama-3-8B"
    assert alignment.stage_config["model_alignment_strategy"]["dpo"]["precompute_ref_log_probs"] is False


def test_data_preparation_makes_the_alignment_inputs(tmp_path):
    """preference_demo writes the pairs and the tokenizer: a real launch does not look for them."""
    plan = _plan(tmp_path, "stages=[data_preparation,alignment]", "data_preparation=preference_demo", dry_run=False)
    assert [w for w in plan.warnings if "preference_demo" in w] == []
    preparation, alignment = plan.jobs
    assert (preparation.array_size, alignment.stage) == (1, "alignment")
    assert plan.cfg["data_preparation"]["output_dir"] == f"{tmp_path}/data/preference_demo"
    # The SFT demo's data is no preference data: the pairs are still looked for.
    with pytest.raises(UserError) as caught:
        _plan(tmp_path, "stages=[data_preparation,alignment]", "data_preparation=sft_demo", dry_run=False)
    assert any(p.startswith("alignment.model.data.train_ds.file_names: ") and "does not exist" in p
               for p in caught.value.problems), caught.value.problems


def test_alignment_restores_from_this_launchs_fine_tuning(tmp_path):
    """SFT then DPO in one launch: restore_from_path at the fine_tuning stage's checkpoints, which do not exist yet;
    the alignment job waits for it (afterok) and reads the newest of them."""
    data = tmp_path / "data"
    _sft_demo_files(data)
    _preference_demo_files(data)
    chained = ["stages=[fine_tuning,alignment]",
               "alignment.model.restore_from_path=${fine_tuning.run.results_dir}/checkpoints"]
    plan = _plan(tmp_path, *chained, dry_run=False)
    fine_tuning, alignment = plan.jobs
    assert alignment.dependency == "afterok"
    assert alignment.stage_config["model"]["restore_from_path"] == f"{fine_tuning.results_dir}/checkpoints"
    # Without fine_tuning in the launch (or after alignment), the same path is an input that must exist.
    for stages in ("stages=[alignment]", "stages=[alignment,fine_tuning]"):
        with pytest.raises(UserError) as caught:
            _plan(tmp_path, *chained[1:], stages, dry_run=False)
        assert any(p.startswith("alignment.model.restore_from_path: ") and "does not exist" in p
                   for p in caught.value.problems), (stages, caught.value.problems)


def test_preference_files_on_s3_are_staged_like_chat_files(tmp_path):
    plan = _plan(tmp_path, "stages=[alignment]", "data_dir=s3://bucket/datasets",
                 "cluster.staging.local_dir=/fsx/staging")
    data = plan.jobs[0].stage_config["model"]["data"]
    assert data["train_ds"]["file_names"] == ["/fsx/staging/bucket/datasets/preference_demo/train.jsonl"]
    assert plan.jobs[0].stage_config["model"]["tokenizer"]["model"] == \
        "/fsx/staging/bucket/datasets/preference_demo/tokenizer.json"


# recipe -> the cluster config it is meant for, the device the estimator should pick for it
def _intended(recipe: str) -> tuple[str, str]:
    if "tiny" in recipe:
        return "slurm", "cpu"
    if recipe.endswith("_gpu"):
        return "slurm", "h100"
    return ("pcluster_trn2", "trn2") if recipe.endswith("_trn2") else ("pcluster_trn1", "trn1")


RECIPES = group_choices("alignment")
REAL_SIZE = [recipe for recipe in RECIPES if "tiny" not in recipe]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_dry_runs_and_fits(recipe, tmp_path):
    cluster, device = _intended(recipe)
    plan = _plan(tmp_path, "stages=[alignment]", f"alignment={recipe}", f"cluster={cluster}", data_dir=Path("/data"))
    # Only the files this machine does not have (the weights, tokenizer and preference data of /data).
    assert [w for w in plan.warnings if "does not exist" not in w] == [], plan.warnings
    (script,) = launch.write(plan)
    stage = plan.cfg["alignment"]
    trainer, model = stage["trainer"], stage["model"]
    text = script.read_text()
    assert "--stage alignment" in text and f"#SBATCH --nodes={trainer['num_nodes']}" in text
    assert f"--nproc_per_node {trainer['devices']}" in text
    assert model["data"]["data_prefix"] is None and "packing" not in model["data"]
    assert model["context_parallel_size"] == model["ulysses_parallel_size"] == 1
    if recipe in REAL_SIZE:
        # NxD Training's Llama-3 8B DPO settings, at a tp that keeps every KV head on one rank.
        dpo = stage["model_alignment_strategy"]["dpo"]
        assert (stage["strategy"], dpo["kl_beta"], dpo["loss_type"], dpo["max_dpo_prompt_length"]) == \
            ("dpo", 0.01, "sigmoid", 2048)
        assert (model["encoder_seq_length"], model["micro_batch_size"], model["global_batch_size"]) == (4096, 1, 64)
        assert model["optim"]["lr"] <= 5e-6 and model["tensor_model_parallel_size"] <= model["num_query_groups"]
        assert model["restore_from_path"].startswith("/data/hf/") and trainer["accelerator"] != "cpu"
        if trainer["accelerator"] == "neuron":
            assert stage["precision"]["type"] == "mixed_precision" and "neuron_parallel_compile" in text
    lora = (model.get("peft") or {}).get("peft_scheme") == "lora"
    assert lora == recipe.endswith("_lora")
    if stage["strategy"] == "dpo":  # the reference: precomputed, or the base with adapters off (LoRA only)
        assert stage["model_alignment_strategy"]["dpo"]["precompute_ref_log_probs"] is not lora
    # The estimator sizes the stage as the launch does: a pair is two rows through the model, LoRA's frozen
    # weights keep no gradients or optimizer state.
    neuron = ((plan.cfg.get("cluster") or {}).get("neuron") or {}).get("hardware")
    result = estimate(copy.deepcopy(stage), neuron_hardware=neuron, node_memory_bytes=64 * GIB,
                      vocab_size=512 if "tiny" in recipe else 128256, stage="alignment")
    assert result.hardware.name == device
    assert result.layout.micro_batch_size == 2 * model["micro_batch_size"]
    memory = result.memory
    if lora:
        assert memory.gradients == memory.optimizer == 0, recipe
    assert memory.total <= result.hardware.usable_bytes, (recipe, memory.total / GIB,
                                                          result.hardware.usable_bytes / GIB)
    # Host memory per node, against the cluster's nodes (LoRA: the frozen weights alone).
    assert host_memory_problems(plan.cfg, "alignment", vocab_size=512 if "tiny" in recipe else 128256) == []
    sched = model["optim"]["sched"]
    assert sched["warmup_steps"] + sched["constant_steps"] <= trainer["max_steps"]


@pytest.fixture(scope="module")
def hf_data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_data")
    (root / "hf" / "Meta-Llama-3-8B").mkdir(parents=True)
    (root / "hf" / "Meta-Llama-3-8B" / "config.json").write_text(json.dumps(LLAMA3_8B))
    write_tokenizer(root / "hf" / "Meta-Llama-3-8B" / "tokenizer.json", 128256)
    write_hf_weights(root / "hf" / "Meta-Llama-3-8B", LLAMA3_8B, 128256)
    (root / "preference").mkdir()
    for split in ("train", "validation"):
        (root / "preference" / f"{split}.jsonl").write_text(json.dumps(PAIR) + "\n")
    return root


@pytest.mark.parametrize("recipe", REAL_SIZE)
def test_recipe_matches_the_model_it_restores(recipe, hf_data_dir):
    """With the published config.json, a tokenizer of the real vocabulary and preference files in place, every file
    check runs as at a real launch."""
    cluster, _ = _intended(recipe)
    stage = resolved(f"alignment={recipe}", f"cluster={cluster}", f"data_dir={hf_data_dir}")["alignment"]
    _, report = parse_training(stage, files="error", p="alignment.")
    assert report.errors == [] and report.warnings == [], (report.errors, report.warnings)


# NxD Training's DPO and ORPO examples (hf_llama3_8B_DPO_config.yaml keeps its section under
# data.alignment_strategy, hf_llama3_8B_ORPO_config.yaml under model_alignment_strategy).
def _nxd(tmp_path, *overrides):
    plan = launch.make_plan(["cluster=pcluster_trn1", "cluster_type=slurm", "data_dir=/data",
                             f"base_results_dir={tmp_path}", "stages=[alignment]", *overrides],
                            dry_run=True, produced_by="test")
    return plan, plan.cfg["alignment"]


@pytest.mark.parametrize("file,strategy", [(DPO_FILE, "dpo"), (ORPO_FILE, "orpo")])
def test_nxd_alignment_files_run_as_the_alignment_stage(file, strategy, tmp_path):
    plan, ours = _nxd(tmp_path, f"alignment=@{file}")
    model = ours["model"]
    assert ours["strategy"] == strategy and list(ours["model_alignment_strategy"]) == [strategy]
    section = ours["model_alignment_strategy"][strategy]
    if strategy == "dpo":
        assert section == {"kl_beta": 0.01, "loss_type": "sigmoid", "max_dpo_prompt_length": 2048,
                           "precompute_ref_log_probs": True, "truncation_mode": "keep_start"}
        assert (model["global_batch_size"], model["optim"]["lr"]) == (4, 5e-7)
    else:
        assert section == {"beta": 0.1, "max_prompt_length": 2048, "truncation_mode": "keep_start"}
        assert (model["global_batch_size"], model["optim"]["lr"]) == (16, 1.5e-4)
    assert model["data"]["train_ds"]["file_names"] == [f"/home/ubuntu/data_{strategy}.jsonl"]
    assert model["data"]["validation_ds"]["file_names"] == []  # val_dir: null
    assert "packing" not in model["data"] and model["data"]["data_prefix"] is None
    assert model["restore_from_path"] == "/home/ubuntu/pretrained_ckpt"
    # The positions are model_config's config.json's (the file's max_position_embeddings is not carried over).
    assert (model["encoder_seq_length"], model["max_position_embeddings"]) == (4096, None)
    assert (model["tensor_model_parallel_size"], model["activations_checkpoint_granularity"]) == (32, "full")
    assert (model.get("peft") or {}).get("peft_scheme") is None
    (script,) = launch.write(plan)
    assert script == tmp_path / "hf_llama" / "alignment" / "alignment.sbatch"
    assert "--stage alignment" in script.read_text()


def test_nxd_alignment_with_lora_and_two_strategies(tmp_path):
    text = ORPO_FILE.read_text()
    lora = tmp_path / "orpo_lora.yaml"
    lora.write_text(text.replace("model_alignment_strategy:\n", "model_alignment_strategy:\n  peft:\n"
                                 "    lora_rank: 16\n    lora_alpha: 32\n    lora_dropout: 0.05\n"
                                 "    target_modules: [qkv_proj]\n"))
    _, ours = _nxd(tmp_path, f"alignment=@{lora}", "alignment.model.tensor_model_parallel_size=8")
    assert ours["model"]["peft"] == {"peft_scheme": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                                     "target_modules": ["qkv_proj"]}
    both = tmp_path / "both.yaml"
    both.write_text(text.replace("model_alignment_strategy:\n", "model_alignment_strategy:\n  dpo:\n"
                                 "    kl_beta: 0.1\n"))
    result = nxdt(f"alignment=@{both}", "stages=[alignment]", f"base_results_dir={tmp_path}/r", "--dry-run",
                  cwd=tmp_path)
    _one_error_line(result, f"alignment=@{both}: model_alignment_strategy: both dpo and orpo are set")


@pytest.mark.parametrize("given,file,expected", [
    ("fine_tuning", DPO_FILE, "it aligns (data.alignment_strategy.dpo), so it runs as the alignment stage: launch it "
                              "with stages=[alignment] alignment=@"),
    ("training", ORPO_FILE, "it aligns (model_alignment_strategy.orpo), so it runs as the alignment stage: launch it "
                            "with stages=[alignment] alignment=@"),
    ("alignment", SFT_FILE, "it fine-tunes (model_alignment_strategy.sft), so it runs as the fine_tuning stage: "
                            "launch it with stages=[fine_tuning] fine_tuning=@"),
])
def test_a_file_given_as_another_stage_names_its_own(given, file, expected, tmp_path):
    result = nxdt(f"{given}=@{file}", f"stages=[{given}]", f"base_results_dir={tmp_path}/r", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {given}=@{file}: {expected}{file}"]
    assert not list(tmp_path.iterdir()), "a refused file wrote something"


def test_explain_config_shows_the_alignment_keys(tmp_path):
    result = nxdt("explain-config", str(DPO_FILE), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.replace("│", " ").split())
    for row in ("data.alignment_strategy.dpo.kl_beta 0.01 alignment.model_alignment_strategy.dpo.kl_beta",
                "(implied) data.alignment_strategy.dpo 'dpo' alignment.strategy = 'dpo'",
                "exp_manager.resume_from_checkpoint '/home/ubuntu/pretrained_ckpt' alignment.model.restore_from_path",
                "data.val_dir None alignment.model.data.validation_ds.file_names = []",
                "(not in the file) run.preemption_signal_s 120 alignment.run.preemption_signal_s, from the base "
                "recipe alignment/llama/tiny_dpo",
                f"launch it with: nxdt-launch stages=[alignment] alignment=@{DPO_FILE}"):
        assert row in flat, row


# Mistakes the launcher finds: one `error:` line each, exit code 2, nothing written.
BAD = [
    (["stages=[alignment]", "alignment.strategy=kto"], "alignment.strategy: 'kto'"),
    (["stages=[alignment]", "alignment=llama3/8b_trn2", "cluster=pcluster_trn2", "alignment.trainer.devices=32"],
     "alignment.trainer.devices: 32 workers per node, but trn2 (LNC=2) nodes have 64 NeuronCores, one worker each; "
     "set alignment.trainer.devices=64"),
    (["stages=[fine_tuning]", "+fine_tuning.model_alignment_strategy.dpo.kl_beta=0.1"],
     "fine_tuning.model_alignment_strategy.dpo: preference alignment runs in the alignment stage"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(overrides, expected, tmp_path):
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
                  *overrides, "--dry-run", cwd=tmp_path)
    _one_error_line(result, expected)
    assert not list(tmp_path.iterdir()), "a rejected launch wrote files"
