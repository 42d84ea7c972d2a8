"""NeMo-Launcher's current files (tests/fixtures/nemo, from NeMo-Framework-Launcher 26e42fa9) through
`training=@FILE --dry-run`: each training file renders its own layout on a GPU cluster and our recipe's Trainium
layout for its model on pcluster_trn1; its implementation-only keys are accepted and summed up in one warning; what
would change the math is mapped or refused in one line per problem, before anything is written."""

import pytest

from launcher import launch, nxdt_config
from launcher.errors import UserError

from .helpers import REPO

FIXTURES = REPO / "tests" / "fixtures" / "nemo"
# The Llama 3 files separate documents (reset_position_ids / reset_attention_mask: true) and split sequences over
# cp 2 on GPUs: each context rank masks its attention by the whole row's documents (runtime/parallel/ring_attention.py),
# so they run unchanged there as on pcluster_trn1.

# file -> its layout as NeMo-Launcher publishes it: (nodes, GPUs per node, tp, pp, vpp, cp, ep, sp, seq, global
# batch, micro-batch, max steps, recompute); precision is bf16 with O2 (mixed_precision) in every one.
GPU = {
    "training_gpt3_126m": (8, 8, 1, 1, None, 1, 1, False, 2048, 256, 4, 600000, None),
    "training_gpt3_5b": (16, 8, 1, 1, None, 1, 1, False, 2048, 2048, 4, 75000, None),
    "training_gpt3_175b": (128, 8, 4, 8, 6, 1, 1, True, 2048, 2048, 1, 75000, None),
    "training_llama_llama2_7b": (16, 8, 1, 1, None, 1, 1, False, 4096, 2048, 1, 300000, None),
    "training_llama_llama3_8b": (16, 8, 1, 1, None, 2, 1, False, 8192, 2048, 1, 300000, None),
    "training_llama_llama3_1_70b": (128, 8, 4, 4, 10, 2, 1, True, 8192, 2048, 1, 300000, None),
    "training_mixtral_mixtral_8x7b": (8, 8, 1, 4, 8, 1, 8, True, 4096, 256, 1, 300000, None),
}
# file -> (our recipe for its model, the one that holds that recipe's trn1 layout)
RECIPES = {
    "training_gpt3_126m": ("gpt3/126m", "gpt3/126m_trn1"),
    "training_gpt3_5b": ("gpt3/5b", "gpt3/5b_trn1"),
    "training_gpt3_175b": ("gpt3/175b", "gpt3/175b_trn1"),
    "training_llama_llama2_7b": ("llama2/7b", "llama2/7b"),
    "training_llama_llama3_8b": ("llama3/8b", "llama3/8b"),
    "training_llama_llama3_1_70b": ("llama3_1/70b", "llama3_1/70b"),
    "training_mixtral_mixtral_8x7b": ("mixtral/8x7b", "mixtral/8x7b"),
}
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size", "expert_model_parallel_size", "sequence_parallel")
# Keys that only choose NeMo's implementation, as the current files set them: ignored, each with its reason.
IMPLEMENTATION = ("defaults", "model.transformer_engine", "model.gc_interval", "model.apply_rope_fusion",
                  "model.bias_activation_fusion", "model.masked_softmax_fusion", "model.optim.contiguous_param_buffer",
                  "model.optim.contiguous_grad_buffer", "model.ub_tp_comm_overlap", "model.nsys_profile",
                  "model.fp8_hybrid", "model.use_flash_attention", "model.defer_embedding_wgrad_compute")


def _file(name, tmp_path):
    """The fixture as NeMo-Launcher publishes it."""
    return FIXTURES / f"{name}.yaml"


def _plan(tmp_path, cluster, *overrides):
    plan = launch.make_plan(["stages=[training]", f"cluster={cluster}", "cluster_type=slurm", "data_dir=/data",
                             f"base_results_dir={tmp_path}/results", *overrides], dry_run=True, produced_by="test")
    return plan, plan.cfg["training"]


def _layout(training):
    model, trainer = training["model"], training["trainer"]
    return (trainer["num_nodes"], trainer["devices"], *(model[key] for key in LAYOUT_KEYS),
            model["encoder_seq_length"], model["global_batch_size"], model["micro_batch_size"], trainer["max_steps"],
            model["activations_checkpoint_granularity"])


@pytest.mark.parametrize("name", sorted(GPU))
def test_current_training_file_renders_its_gpu_layout(name, tmp_path):
    plan, training = _plan(tmp_path, "slurm", f"training=@{_file(name, tmp_path)}")
    assert _layout(training) == GPU[name]
    assert training["trainer"]["accelerator"] == "gpu" and training["precision"]["type"] == "mixed_precision"
    assert training["model"]["encoder_seq_length"] == training["model"]["data"]["seq_length"]
    assert training["model"]["architecture"] == ("gpt" if "gpt3" in name else "llama")
    ignored = [w for w in plan.warnings if "NeMo keys ignored" in w]
    assert len(ignored) == 1, plan.warnings  # one summary, not a warning per key
    # Missing inputs are a dry run's warnings: the tokenizer (a hub name for Llama 3 and Mixtral) and the data.
    assert any(w.startswith("training.model.tokenizer.model: ") and "does not exist" in w for w in plan.warnings)
    assert any("30 of 30 datasets are missing" in w for w in plan.warnings)
    (script,) = launch.write(plan)
    assert f"#SBATCH --nodes={GPU[name][0]}" in script.read_text()


@pytest.mark.parametrize("name", sorted(GPU))
def test_current_training_file_runs_our_trn1_layout_for_its_model(name, tmp_path):
    """On pcluster_trn1 the file keeps its model, data, batch and schedule, with the trn1 layout of our recipe for
    the same model (launcher/targets.py, as training=<recipe> does)."""
    recipe, layout_recipe = RECIPES[name]
    _, ours = _plan(tmp_path, "pcluster_trn1", f"training=@{_file(name, tmp_path)}")
    _, theirs = _plan(tmp_path, "pcluster_trn1", f"training={recipe}")
    for key in (*LAYOUT_KEYS, "micro_batch_size", "zero1", "activations_checkpoint_granularity",
                "activations_checkpoint_recompute"):
        assert ours["model"][key] == theirs["model"][key], (key, ours["model"][key], theirs["model"][key])
    for key in ("num_nodes", "devices", "accelerator"):
        assert ours["trainer"][key] == theirs["trainer"][key], key
    assert ours["trainer"]["accelerator"] == "neuron" and ours["trainer"]["devices"] == 32
    gpu = GPU[name]
    assert (ours["model"]["encoder_seq_length"], ours["model"]["global_batch_size"], ours["trainer"]["max_steps"]) \
        == (gpu[8], gpu[9], gpu[11])  # the file's own math
    assert ours["precision"]["type"] == "mixed_precision" and ours["run"]["name"] == theirs["run"]["name"].removesuffix(
        "_trn1")
    assert len(ours["model"]["data"]["data_prefix"]) == 60  # the file's 30 datasets, not the recipe's blend


def test_llama3_files_separate_documents_under_context_parallelism_on_gpus(tmp_path):
    for name in ("training_llama_llama3_8b", "training_llama_llama3_1_70b"):
        path = FIXTURES / f"{name}.yaml"
        for cluster in ("slurm", "pcluster_trn1"):
            _, training = _plan(tmp_path, cluster, f"training=@{path}")
            data = training["model"]["data"]
            assert data["reset_position_ids"] is True and data["reset_attention_mask"] is True
        assert training["model"]["context_parallel_size"] == 1  # our trn1 recipe's layout
        _, training = _plan(tmp_path, "slurm", f"training=@{path}")
        assert training["model"]["context_parallel_size"] == 2


def test_implementation_only_keys_are_accepted_with_their_reason(tmp_path):
    mapping = nxdt_config.map_file(str(_file("training_llama_llama3_1_70b", tmp_path)))
    rows = {key: what for key, _, what in mapping.rows}
    for key in IMPLEMENTATION:
        assert any(k == key or k.startswith(key + ".") for k in rows), key
        assert all(what.startswith("ignored: ") for k, what in rows.items() if k == key or k.startswith(key + ".")), key
    (summary,) = [w for w in mapping.warnings if "NeMo keys ignored" in w]
    assert "explain-config" in summary


def test_what_changes_the_math_is_mapped(tmp_path):
    model = nxdt_config.map_file(str(FIXTURES / "training_mixtral_mixtral_8x7b.yaml")).training["model"]
    assert model["moe"] == {"num_experts": 8, "top_k": 2, "frequency": 1, "capacity_factor": 1.0, "dropless": False,
                            "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.0,
                            "normalize_top_k_affinities": True, "router_activation": "softmax"}
    assert model["rotary_base"] == 1e6 and model["architecture"] == "llama"
    assert (model["optim"]["name"], model["zero1"]) == ("adamw", True)  # mcore_distributed_optim
    model = nxdt_config.map_file(str(_file("training_llama_llama3_1_70b", tmp_path))).training["model"]
    assert model["rope_scaling"]["rope_type"] == "llama3" and model["rope_scaling"]["factor"] == 8.0
    tokenizers = {name: nxdt_config.map_file(str(_file(name, tmp_path))).training["model"]["tokenizer"]["model"]
                  for name in ("training_gpt3_126m", "training_llama_llama2_7b", "training_llama_llama3_8b")}
    assert tokenizers == {"training_gpt3_126m": "${data_dir}/bpe/tokenizer.json",  # beside vocab.json, merges.txt
                          "training_llama_llama2_7b": "${data_dir}/llama/tokenizer.json",  # beside the .model
                          "training_llama_llama3_8b": "${data_dir}/meta-llama/Meta-Llama-3-8B/tokenizer.json"}


def test_a_defaults_entry_naming_another_config_is_refused(tmp_path):
    text = (FIXTURES / "training_gpt3_126m.yaml").read_text()
    (tmp_path / "base.yaml").write_text("defaults:\n  - gpt3/base\n  - _self_\n\n" + text)
    mapping = nxdt_config.map_file(str(tmp_path / "base.yaml"))
    assert len(mapping.errors) == 1 and "defaults ['gpt3/base'] composes NeMo configs" in mapping.errors[0]


# squad file -> the lines it is refused with (the key each begins with)
SQUAD = {
    "fine_tuning_llama_squad": ("model.data.train_ds.file_names", "exp_manager.checkpoint_callback_params."
                                "save_nemo_on_train_end", "model.restore_from_path"),
    "fine_tuning_gpt3_squad": ("model.data.train_ds.file_names", "exp_manager.checkpoint_callback_params."
                               "save_nemo_on_train_end", "model.restore_from_path"),
    "peft_llama_squad": ("model.data.train_ds.file_names", "exp_manager.checkpoint_callback_params."
                         "save_nemo_on_train_end", "exp_manager.create_early_stopping_callback",
                         "model.restore_from_path"),
    "peft_gpt3_squad": ("model.data.train_ds.file_names", "exp_manager.checkpoint_callback_params."
                        "save_nemo_on_train_end", "exp_manager.create_early_stopping_callback",
                        "model.restore_from_path"),
}


@pytest.mark.parametrize("name", sorted(SQUAD))
def test_squad_files_are_refused_one_line_per_problem(name, tmp_path):
    stage = name.rsplit("_", 2)[0]
    with pytest.raises(UserError) as caught:
        launch.make_plan([f"stages=[{stage}]", f"{stage}=@{FIXTURES / name}.yaml", "cluster=slurm",
                          "cluster_type=slurm", f"base_results_dir={tmp_path}/results"], dry_run=True,
                         produced_by="test")
    keys = tuple(p.split(": ", 1)[1].split(" ")[0] for p in caught.value.problems)
    assert keys == SQUAD[name], caught.value.problems
    data = caught.value.problems[0]
    assert "prompt/completion" in data and "jq -c" in data  # what we read, and how to convert
    assert not (tmp_path / "results").exists()


def test_squad_file_with_our_data_and_weights_maps_its_lora(tmp_path):
    """With converted data and a Hugging Face directory, NeMo's peft squad file is our peft stage."""
    text = (FIXTURES / "peft_llama_squad.yaml").read_text()
    for old, new in (("${peft.run.convert_dir}/results/megatron_llama.nemo", "/fsx/hf/Llama-2-7b-hf"),
                     ("save_nemo_on_train_end: True", "save_nemo_on_train_end: False"),
                     ("create_early_stopping_callback: True", "create_early_stopping_callback: False"),
                     ("train-v1.1_gpt.json", "train.jsonl"), ("dev-v1.1_gpt.json", "dev.jsonl")):
        assert old in text, old
        text = text.replace(old, new)
    for field in ("context_key: 'input'", "label_key: 'output'", 'prompt_template: "{input} {output}"',
                  "prompt_template: ${peft.model.data.train_ds.prompt_template}"):
        text = text.replace(field, "")
    path = tmp_path / "squad.yaml"
    path.write_text(text)
    plan = launch.make_plan(["stages=[peft]", f"peft=@{path}", "cluster=slurm", "cluster_type=slurm",
                             "data_dir=/data", f"base_results_dir={tmp_path}/results"], dry_run=True,
                            produced_by="test")
    model = plan.cfg["peft"]["model"]
    assert model["peft"] == {"peft_scheme": "lora", "lora_rank": 32, "lora_alpha": 32, "lora_dropout": 0.0,
                             "target_modules": ["attention_qkv"]}  # NeMo's defaults for the two it leaves out
    assert model["restore_from_path"] == "/fsx/hf/Llama-2-7b-hf"
    assert model["data"]["train_ds"]["file_names"] == ["/data/squad_data/v1.1/train.jsonl"]
    assert (model["encoder_seq_length"], model["global_batch_size"], model["micro_batch_size"]) == (4096, 128, 4)
    assert (model["optim"]["lr"], plan.cfg["peft"]["trainer"]["max_steps"]) == (1e-4, 20000)
