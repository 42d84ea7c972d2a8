"""NxD Training's published example configs (tests/fixtures/nxdt: their keys and values, comments dropped) run
through `nxdt-launch training=@FILE --dry-run` unchanged and render the layout of our own recipes; what we cannot
honour is refused in one line per key, before anything is written."""

import json

import pytest
import yaml

from launcher import launch, nxdt_config
from launcher.errors import UserError
from launcher.estimator import estimate
from runtime.schema.choices import RECOMPUTE_MODULES
from runtime.schema.training import parse_training

from .helpers import REPO, nxdt

FIXTURES = REPO / "tests" / "fixtures" / "nxdt"
COMMON = ["stages=[training]", "cluster=pcluster_trn1", "cluster_type=slurm", "data_dir=/data"]

# NxD file -> (our recipe, the Hugging Face config.json its model_config names, facts of the published model)
PUBLISHED = {
    "hf_llama3_8B_config": ("llama3/8b", "llama3_8b_config.json"),
    "hf_llama3_70B_config": ("llama3/70b", "llama3_70b_config.json"),
    "hf_llama3.1_8B_config": ("llama3_1/8b", "llama3_8b_config.json"),
    "hf_llama3.1_70B_config": ("llama3_1/70b", "llama3_70b_config.json"),
}
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "sequence_parallel", "zero1", "encoder_seq_length", "global_batch_size", "micro_batch_size")
SHAPE = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
         "rotary_base", "vocab_size", "share_embeddings_and_output_weights")


def _training(tmp_path, *overrides):
    plan = launch.make_plan([*COMMON, f"base_results_dir={tmp_path}", *overrides], dry_run=True, produced_by="test")
    return plan, plan.cfg["training"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_file_dry_runs_unchanged_with_our_recipes_layout(name, tmp_path):
    recipe, _ = PUBLISHED[name]
    plan, ours = _training(tmp_path, f"training=@{FIXTURES / name}.yaml")
    _, theirs = _training(tmp_path, f"training={recipe}")
    for key in LAYOUT:
        assert ours["model"][key] == theirs["model"][key], (key, ours["model"][key], theirs["model"][key])
    for key in ("num_nodes", "devices", "accelerator", "max_steps"):
        assert ours["trainer"][key] == theirs["trainer"][key], key
    assert ours["precision"]["type"] == theirs["precision"]["type"] == "mixed_precision"
    assert ours["model"]["activations_checkpoint_granularity"] == "selective"  # as the file says
    if recipe.endswith("8b"):
        recompute = [RECOMPUTE_MODULES.canonical(m) for m in ours["model"]["activations_checkpoint_recompute"]]
        assert recompute == theirs["model"]["activations_checkpoint_recompute"]
    else:
        # Our 70B recipes recompute whole layers: this runtime keeps each column-parallel input gathered under
        # sequence parallelism, so NxD's selective recompute does not fit a 16 GiB NeuronCore by the estimator
        # (conf/training/llama3/70b.yaml). The file's own choice is kept, not silently replaced.
        assert theirs["model"]["activations_checkpoint_granularity"] == "full"
    # The model_config (/home/ubuntu/config.json) is not on this machine: named as a warning, as the data is.
    assert any("training.model.model_config: /home/ubuntu/config.json does not exist" in w for w in plan.warnings)
    (script,) = launch.write(plan)
    text = script.read_text()
    assert "--nproc_per_node 32" in text and f"#SBATCH --nodes={theirs['trainer']['num_nodes']}" in text
    assert "--model-type transformer" in text  # the file's compiler_flags reach NEURON_CC_FLAGS


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_config_gives_the_published_shape(name, tmp_path, recipe_data_dir):
    """With model_config pointing at the model's config.json, the whole model equals our recipe's."""
    recipe, config_json = PUBLISHED[name]
    _, ours = _training(tmp_path, f"training=@{FIXTURES / name}.yaml",
                        f"training.model.model_config={FIXTURES / config_json}")
    _, theirs = _training(tmp_path, f"training={recipe}", f"data_dir={recipe_data_dir}")
    ours_cfg, report = parse_training(ours, files="error", prepared=True)  # model_config read, no data here
    theirs_cfg, _ = parse_training(theirs, files="error")
    assert report.errors == [] and ours_cfg is not None, report.errors
    for key in SHAPE:
        assert getattr(ours_cfg.model, key) == getattr(theirs_cfg.model, key), key
    assert ours_cfg.model.vocab_size == json.loads((FIXTURES / config_json).read_text())["vocab_size"] == 128256
    assert ours_cfg.optim.name == "adamw"  # adamw_fp32OptState (8B) is the same optimizer here


def test_later_overrides_win_and_the_rules_run_on_the_result(tmp_path):
    file = f"training=@{FIXTURES / 'hf_llama3_8B_config.yaml'}"
    _, training = _training(tmp_path, file, "training.trainer.num_nodes=8")
    assert training["trainer"]["num_nodes"] == 8
    with pytest.raises(UserError) as caught:
        _training(tmp_path, file, "training.model.tensor_model_parallel_size=64")
    assert ("training.model.tensor_model_parallel_size: 64 must divide trainer.devices 32 so every tensor-parallel "
            "group stays inside one node; use a divisor of 32") in caught.value.problems


# NxD Training's SFT and LoRA examples (hf_llama3_8B_SFT_config.yaml, hf_llama3_8B_SFT_lora_config.yaml): the same
# kind of file, run as the fine_tuning and the peft stage.
SFT = FIXTURES / "hf_llama3_8B_SFT_config.yaml"
LORA = FIXTURES / "hf_llama3_8B_SFT_lora_config.yaml"


def _stage(tmp_path, stage, *overrides):
    plan = launch.make_plan(["cluster=pcluster_trn1", "cluster_type=slurm", "data_dir=/data",
                             f"base_results_dir={tmp_path}", f"stages=[{stage}]", *overrides],
                            dry_run=True, produced_by="test")
    return plan, plan.cfg[stage]


@pytest.mark.parametrize("stage,file", [("fine_tuning", SFT), ("peft", LORA)])
def test_nxd_fine_tuning_files_run_as_their_stage(stage, file, tmp_path):
    plan, ours = _stage(tmp_path, stage, f"{stage}=@{file}")
    model = ours["model"]
    assert model["data"]["train_ds"]["file_names"] == ["/home/ubuntu/training.jsonl"]
    assert model["data"]["validation_ds"]["file_names"] == ["/home/ubuntu/validation.jsonl"]
    assert model["data"]["packing"] is True and model["data"]["data_prefix"] is None
    # weight_init_only: true with resume_from_checkpoint: the starting weights, not a run to resume.
    assert model["restore_from_path"] == "/home/ubuntu/pretrained_ckpt/"
    assert ours["exp_manager"]["resume_from_checkpoint"] is None
    # NxD trains on data.seq_length; its model's encoder_seq_length (8192) only sized the positions.
    assert (model["encoder_seq_length"], model["data"]["seq_length"], model["max_position_embeddings"]) == \
        (4096, 4096, 8192)
    assert (ours["trainer"]["num_nodes"], ours["trainer"]["devices"]) == (1, 32)
    assert (model["tensor_model_parallel_size"], model["global_batch_size"]) == (32, 64)
    assert model["tokenizer"]["model"] == "/home/ubuntu/llama3_tokenizer/tokenizer.json"
    if stage == "peft":
        assert model["peft"] == {"peft_scheme": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                                 "target_modules": ["qkv_proj"]}
        assert model["zero1"] is False and ours["precision"]["type"] == "autocast"
    else:
        assert (model.get("peft") or {}).get("peft_scheme") is None and model["zero1"] is True
    # The run is the file's (name: hf_llama), as a training file names it through training.run.name.
    (script,) = launch.write(plan)
    assert script == tmp_path / "hf_llama" / stage / f"{stage}.sbatch"
    assert f"--stage {stage}" in script.read_text()
    assert any("not NxD Training's own checkpoint format" in w for w in plan.warnings)


def test_nxd_lora_at_tp_32_meets_the_kv_head_rule(tmp_path):
    """NxD runs LoRA on Llama 3 8B at TP 32 with its 8 KV heads replicated; k and v adapters here need a whole KV
    head per rank: with the model's config.json read, the schema names the fix, and the fix on the same line runs."""
    config = f"peft.model.model_config={FIXTURES / 'llama3_8b_config.json'}"
    with pytest.raises(UserError) as caught:
        _stage(tmp_path, "peft", f"peft=@{LORA}", config)
    assert ("peft.model.peft.target_modules: k_proj, v_proj with tensor_model_parallel_size 32 above the 8 KV heads "
            "(replicated KV heads): adapt q_proj / o_proj only, or lower tp to 8") in caught.value.problems
    _, ours = _stage(tmp_path, "peft", f"peft=@{LORA}", config, "peft.model.tensor_model_parallel_size=8")
    assert ours["model"]["tensor_model_parallel_size"] == 8


@pytest.mark.parametrize("given,file,expected", [
    ("training", SFT, "it fine-tunes (model_alignment_strategy.sft), so it runs as the fine_tuning stage: launch it "
                      "with stages=[fine_tuning] fine_tuning=@"),
    ("training", LORA, "it fine-tunes (model_alignment_strategy.peft (LoRA)), so it runs as the peft stage: launch it "
                       "with stages=[peft] peft=@"),
    ("fine_tuning", LORA, "it fine-tunes (model_alignment_strategy.peft (LoRA)), so it runs as the peft stage: launch "
                          "it with stages=[peft] peft=@"),
])
def test_a_file_given_as_another_stage_names_its_own(given, file, expected, tmp_path):
    result = nxdt(f"{given}=@{file}", f"stages=[{given}]", f"base_results_dir={tmp_path}/r", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {given}=@{file}: {expected}{file}"]
    assert not list(tmp_path.iterdir()), "a refused file wrote something"


@pytest.mark.parametrize("replace,expected", [
    ({"  peft:\n      lora_rank: 16": "  dpo:\n    beta: 0.1\n  peft:\n      lora_rank: 16"},
     "it aligns (model_alignment_strategy.dpo), so it runs as the alignment stage: launch it with "
     "stages=[alignment] alignment=@"),
    ({'lora_bias: "none"': 'lora_bias: "all"'},
     "model_alignment_strategy.peft.lora_bias is not supported: trainable biases beside the adapters are not built"),
    ({"load_lora_from_ckpt: False": "load_lora_from_ckpt: True"},
     "model_alignment_strategy.peft.load_lora_from_ckpt is not supported: starting from saved adapters is not built"),
    ({"  resume_from_checkpoint: /home/ubuntu/pretrained_ckpt/\n": ""},
     "model.weight_init_only: True without exp_manager.resume_from_checkpoint: there are no weights to start from"),
])
def test_what_cannot_run_is_refused_in_one_line_per_key(replace, expected, tmp_path):
    text = LORA.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    file = tmp_path / "lora.yaml"
    file.write_text(text)
    result = nxdt(f"peft=@{file}", "stages=[peft]", f"base_results_dir={tmp_path}/r", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: peft=@{file}: {expected}"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.yaml"]


def test_explain_config_shows_the_fine_tuning_keys(tmp_path):
    result = nxdt("explain-config", str(LORA), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.replace("│", " ").split())
    for row in ("model_alignment_strategy.peft.lora_rank 16 peft.model.peft.lora_rank",
                "model_alignment_strategy.sft.packing True peft.model.data.packing",
                "exp_manager.resume_from_checkpoint '/home/ubuntu/pretrained_ckpt/' peft.model.restore_from_path",
                "data.val_dir '/home/ubuntu/validation.jsonl' peft.model.data.validation_ds.file_names",
                "model_alignment_strategy.peft.merge_lora False ignored: the conversion stage exports a LoRA run",
                "(not in the file) run.preemption_signal_s 120 peft.run.preemption_signal_s, from the base recipe "
                "peft/llama/tiny"):
        assert row in flat, row


# NeMo-Launcher's conf/peft/llama/squad.yaml and conf/fine_tuning/llama/squad.yaml, their fine-tuning keys (the
# layout and data keys, trimmed: what the mapping reads).
NEMO_PEFT = """\
run:
  name: ${.task_name}_${.model_train_name}
  time_limit: "04:00:00"
  dependency: "singleton"
  model_train_name: llama2_7b
  task_name: "squad"
trainer:
  devices: 8
  num_nodes: 1
  accelerator: gpu
  precision: bf16
  max_steps: 2000
  log_every_n_steps: 10
  val_check_interval: 200
  gradient_clip_val: 1.0
exp_manager:
  resume_if_exists: True
  create_checkpoint_callback: True
  checkpoint_callback_params:
    save_top_k: 1
model:
  seed: 1234
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  global_batch_size: 128
  micro_batch_size: 1
  restore_from_path: /fsx/hf/Llama-2-7b-hf
  megatron_amp_O2: True
  answer_only_loss: True
  peft:
    peft_scheme: "lora"
    restore_from_path: null
    lora_tuning:
      target_modules: ['attention_qkv']
      adapter_dim: 32
      alpha: 32
      adapter_dropout: 0.0
      column_init_method: 'xavier'
      row_init_method: 'zero'
      layer_selection: null
      weight_tying: False
      position_embedding_strategy: null
  data:
    train_ds:
      file_names: [/fsx/squad/train.jsonl]
    validation_ds:
      file_names: [/fsx/squad/validation.jsonl]
  optim:
    name: fused_adam
    lr: 1e-4
"""


def test_nemo_peft_file_maps_its_lora_keys(tmp_path):
    file = tmp_path / "squad.yaml"
    file.write_text(NEMO_PEFT)
    plan, ours = _stage(tmp_path, "peft", f"peft=@{file}", "cluster=slurm")
    model = ours["model"]
    assert model["peft"] == {"peft_scheme": "lora", "lora_rank": 32, "lora_alpha": 32, "lora_dropout": 0.0,
                             "target_modules": ["attention_qkv"]}
    assert model["restore_from_path"] == "/fsx/hf/Llama-2-7b-hf"
    assert model["data"]["train_ds"]["file_names"] == ["/fsx/squad/train.jsonl"]
    assert model["data"]["validation_ds"]["file_names"] == ["/fsx/squad/validation.jsonl"]
    assert ours["precision"]["type"] == "mixed_precision" and model["optim"]["lr"] == 1e-4
    assert plan.cfg["run_name"] == "squad_llama2_7b"
    # Without LoRA it is NeMo-Launcher's fine_tuning stage.
    file.write_text(NEMO_PEFT.replace('peft_scheme: "lora"', 'peft_scheme: "none"'))
    _, ours = _stage(tmp_path, "fine_tuning", f"fine_tuning=@{file}", "cluster=slurm")
    assert ours["model"]["peft"]["peft_scheme"] is None


@pytest.mark.parametrize("old,new,expected", [
    ('peft_scheme: "lora"', 'peft_scheme: "ptuning"',
     "model.peft.peft_scheme 'ptuning' is not built here: LoRA (lora) is, or none for full fine-tuning"),
    ("restore_from_path: /fsx/hf/Llama-2-7b-hf", "restore_from_path: /fsx/llama2_7b.nemo",
     "model.restore_from_path '/fsx/llama2_7b.nemo': a .nemo archive is not read here"),
    ("weight_tying: False", "weight_tying: True", "model.peft.lora_tuning.weight_tying True is not supported"),
])
def test_nemo_fine_tuning_keys_we_cannot_honour(old, new, expected, tmp_path):
    file = tmp_path / "squad.yaml"
    file.write_text(NEMO_PEFT.replace(old, new))
    stage = "fine_tuning" if "ptuning" in new else "peft"
    result = nxdt(f"{stage}=@{file}", f"stages=[{stage}]", f"base_results_dir={tmp_path}/r", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert any(line.startswith(f"error: {stage}=@{file}: {expected}") for line in result.stderr.splitlines()), \
        result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["squad.yaml"]


# Mixtral 8x7B's config.json as Mistral AI publishes it (Hugging Face mistralai/Mixtral-8x7B-v0.1), the file NxD
# Training's model.model_config points at.
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
    "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "output_router_logits": False, "sliding_window": None,
    "tie_word_embeddings": False, "initializer_range": 0.02, "attention_dropout": 0.0, "vocab_size": 32000,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "use_cache": True,
}


def _mixtral_file(tmp_path, dropless: bool = False, **replace: str):
    """NxD Training's hf_mixtral_8x7b_config.yaml, or its dropless twin (hf_mixtral_8x7b_dropless_config.yaml: the
    same file with dropless true and capacity_factor 0.0), with `replace`'s lines swapped in."""
    text = (FIXTURES / "hf_mixtral_8x7b_config.yaml").read_text()
    if dropless:
        text = text.replace("    capacity_factor: 2.0", "    capacity_factor: 0.0").replace(
            "    dropless: False", "    dropless: True").replace("name: hf_mixtral", "name: hf_mixtral_dropless")
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / ("hf_mixtral_8x7b_dropless_config.yaml" if dropless else "hf_mixtral_8x7b_config.yaml")
    path.write_text(text)
    return path


@pytest.mark.parametrize("dropless,recipe", [(False, "mixtral/8x7b"), (True, "mixtral/8x7b_dropless")])
def test_nxd_mixtral_files_dry_run_with_our_recipes_layout(dropless, recipe, tmp_path):
    plan, ours = _training(tmp_path, f"training=@{_mixtral_file(tmp_path, dropless)}")
    _, theirs = _training(tmp_path, f"training={recipe}")
    for key in (*LAYOUT, "expert_model_parallel_size", "activations_checkpoint_granularity"):
        assert ours["model"][key] == theirs["model"][key], (key, ours["model"][key], theirs["model"][key])
    model = ours["model"]
    assert (model["expert_model_parallel_size"], model["activations_checkpoint_granularity"]) == (1, "full")
    for key in ("num_nodes", "devices", "accelerator", "max_steps"):
        assert ours["trainer"][key] == theirs["trainer"][key], key
    for key in ("num_experts", "top_k", "frequency", "dropless", "router_aux_loss_coef", "normalize_top_k_affinities"):
        assert ours["model"]["moe"][key] == theirs["model"]["moe"][key], key
    (script,) = launch.write(plan)
    text = script.read_text()
    assert "--nproc_per_node 32" in text and "#SBATCH --nodes=8" in text


@pytest.mark.parametrize("dropless,recipe", [(False, "mixtral/8x7b"), (True, "mixtral/8x7b_dropless")])
def test_nxd_mixtral_with_its_config_json_is_our_recipes_model(dropless, recipe, tmp_path, recipe_data_dir):
    """The whole model, MoE included, equals our recipe's: capacity 2.0 (or dropless: NxD's capacity_factor 0.0 is
    no capacity), top-2 renormalized, softmax router, aux loss 0.02, in every layer."""
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    _, ours = _training(tmp_path, f"training=@{_mixtral_file(tmp_path, dropless)}",
                        f"training.model.model_config={config_json}")
    _, theirs = _training(tmp_path, f"training={recipe}", f"data_dir={recipe_data_dir}")
    ours_cfg, report = parse_training(ours, files="error", prepared=True)
    theirs_cfg, _ = parse_training(theirs, files="error")
    assert report.errors == [] and ours_cfg is not None, report.errors
    for key in (*SHAPE, "moe", "max_position_embeddings"):
        assert getattr(ours_cfg.model, key) == getattr(theirs_cfg.model, key), key
    assert ours_cfg.model.moe.capacity_factor == (None if dropless else 2.0)
    assert ours_cfg.parallel.ep == theirs_cfg.parallel.ep == 1


def test_nxd_moe_keys_left_out_take_nxd_defaults(tmp_path):
    """NxD's Mixtral module reads each model.moe key with a default of its own (top_k 1, capacity 1.0, aux loss
    0.02), over config.json's; and it adds no load-balancing loss when the router logits are not output."""
    file = _mixtral_file(tmp_path, **{"    top_k: 2\n": "", "    capacity_factor: 2.0\n": "",
                                      "    output_router_logits: True": "    output_router_logits: False",
                                      "  expert_model_parallel_size: 1": "  expert_model_parallel_size: 2"})
    _, training = _training(tmp_path, f"training=@{file}")
    moe = training["model"]["moe"]
    assert (moe["top_k"], moe["capacity_factor"], moe["router_aux_loss_coef"]) == (1, 1.0, 0.0)
    assert training["model"]["expert_model_parallel_size"] == 2  # DP is 256 / (32 x 4) = 2
    explained = " ".join(nxdt("explain-config", str(file), cwd=tmp_path).stdout.replace("│", " ").split())
    assert "(not in the file) model.moe.top_k 1 training.model.moe.top_k = 1, NxD Training's default" in explained
    assert "training.model.moe.router_aux_loss_coef = 0.0: NxD Training adds the load-balancing loss only" in explained


def test_nxd_null_capacity_factor_is_no_capacity(tmp_path):
    """NxD runs every token through its experts when capacity_factor is null: no default fills it in here."""
    file = _mixtral_file(tmp_path, **{"    capacity_factor: 2.0": "    capacity_factor: null"})
    _, training = _training(tmp_path, f"training=@{file}")
    assert training["model"]["moe"]["capacity_factor"] is None and training["model"]["moe"]["dropless"] is False


def test_nxd_moe_keys_we_cannot_honour_are_refused_one_line_each(tmp_path):
    file = _mixtral_file(tmp_path, **{"routing_algorithm: top_k": "routing_algorithm: sinkhorn",
                                      "    dropout: 0.0": "    dropout: 0.1",
                                      "  expert_model_parallel_size: 1": "  expert_model_parallel_size: 1\n"
                                                                         "  token_shuffle_group_size: 2"})
    result = nxdt(f"training=@{file}", "stages=[training]", f"base_results_dir={tmp_path}/r", "--dry-run",
                  cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: training=@{file}: distributed_strategy.token_shuffle_group_size is not supported: shuffling tokens "
        f"across data-parallel ranks before routing is not built yet; set it to 1",
        f"error: training=@{file}: model.moe.dropout is not supported: dropout in the MoE layer is not built yet; "
        f"set it to 0.0",
        f"error: training=@{file}: model.moe.routing_algorithm is not supported: routing other than top_k (sinkhorn) "
        f"is not built yet; set it to top_k",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [file.name]


@pytest.mark.parametrize("replace,message", [
    ({"  expert_model_parallel_size: 1": "  expert_model_parallel_size: 4"},
     "training.model.expert_model_parallel_size: 4 must divide the data-parallel size 2"),
    # A key of the network that disagrees with the config.json that decides it: both values named.
    ({"    top_k: 2": "    top_k: 9"}, "training.model.moe.top_k: the YAML disagrees with "),
    ({"    capacity_factor: 2.0": "    capacity_factor: 0.0"},
     "training.model.moe.capacity_factor: 0.0 must be a positive number; or set training.model.moe.dropless=true"),
])
def test_nxd_moe_values_the_schema_refuses(replace, message, tmp_path):
    """Mapped keys meet the schema's own rules, named by our key, before anything is written."""
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    with pytest.raises(UserError) as caught:
        _training(tmp_path, f"training=@{_mixtral_file(tmp_path, **replace)}",
                  f"training.model.model_config={config_json}")
    assert any(problem.startswith(message) for problem in caught.value.problems), caught.value.problems


def test_unknown_and_unreadable_files(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text(yaml.safe_dump({"trainer": {"devices": 32, "max_stepz": 10}}))
    result = nxdt(f"training=@{bad}", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert f"error: training=@{bad}: trainer.max_stepz is not an NxD Training key nxdt-launch knows" in result.stderr
    result = nxdt(f"training=@{tmp_path}/none.yaml", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and "no such file" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]


def test_explain_config_lists_every_key(tmp_path):
    result = nxdt("explain-config", str(FIXTURES / "hf_llama3_8B_config.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.split())
    for row in ("distributed_strategy.tensor_model_parallel_size", "training.model.tensor_model_parallel_size",
                "model.rope_theta", "training.model.rotary_base", "compiler_cache_url",
                "cluster.neuron.compile.cache", "ignored: KV heads are replicated"):
        assert row in flat, row
    mixtral = nxdt("explain-config", str(FIXTURES / "hf_mixtral_8x7b_config.yaml"), cwd=tmp_path)
    assert mixtral.returncode == 0, mixtral.stderr
    flat = " ".join(mixtral.stdout.replace("│", " ").split())
    for row in ("model.moe.top_k 2 training.model.moe.top_k", "model.moe.capacity_factor 2.0 training.model.moe",
                "distributed_strategy.expert_model_parallel_size 1 training.model.expert_model_parallel_size",
                "model.moe.routing_algorithm 'top_k' the default here", "model.moe.dropout 0.0 the default here"):
        assert row in flat, row


def test_the_documented_commands_run(tmp_path):
    """docs/launcher.md's two commands, as written (results kept out of the checkout)."""
    fixture = "tests/fixtures/nxdt/hf_llama3_8B_config.yaml"
    dry = nxdt("stages=[training]", f"training=@{fixture}", "cluster=pcluster_trn1", "cluster_type=slurm", "--dry-run",
               f"base_results_dir={tmp_path}")
    assert dry.returncode == 0, dry.stderr
    assert (tmp_path / "hf_llama" / "training" / "training.sbatch").is_file()
    explained = nxdt("explain-config", fixture)
    assert explained.returncode == 0 and "launch it with: nxdt-launch training=@" in explained.stdout
    text = (REPO / "docs" / "launcher.md").read_text()
    assert f"training=@{fixture} cluster=pcluster_trn1 cluster_type=slurm --dry-run" in text
    assert f"nxdt-launch explain-config {fixture}" in text


# NeMo-Launcher's conf/training/gpt3/5b.yaml (keys and values, comments dropped): its keys are ours.
NEMO_5B = REPO / "tests" / "fixtures" / "nemo" / "gpt3_5b.yaml"
HF_TOKENIZER = ["training.model.tokenizer.library=huggingface",
                "training.model.tokenizer.model=${data_dir}/the_pile_gpt2/tokenizer.json"]


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def test_nemo_launcher_file_trains_what_our_recipe_trains(tmp_path, recipe_data_dir):
    common = ["stages=[training]", "cluster_type=slurm", f"base_results_dir={tmp_path}", f"data_dir={recipe_data_dir}"]
    plan = launch.make_plan([*common, f"training=@{NEMO_5B}", *HF_TOKENIZER], dry_run=True, produced_by="test")
    ours = launch.make_plan([*common, "training=gpt3/5b"], dry_run=True, produced_by="test").cfg["training"]
    theirs = _flat(plan.cfg["training"])
    differ = {key for key in set(theirs) | set(_flat(ours)) if theirs.get(key) != _flat(ours).get(key)}
    # The file's own blend of 30 datasets and its singleton dependency are kept; everything else is the recipe:
    # layout (16 x 8, TP 1, ZeRO-1 from distributed_fused_adam), shape, bf16 + O2 = mixed_precision, schedule,
    # and checkpoints at every validation (2000 steps), as NeMo's callback saves.
    assert differ == {"model.data.data_prefix", "run.dependency"}, differ
    assert theirs["run.dependency"] == "singleton" and len(theirs["model.data.data_prefix"]) == 60
    assert any("30 of 30 datasets are missing" in w for w in plan.warnings)  # a dry run only warns
    assert any("NeMo keys ignored" in w for w in plan.warnings)


def test_nemo_launcher_file_names_what_is_left_to_fix(tmp_path):
    """Its Megatron tokenizer (vocab_file + merge_file) is not ours: the schema says so, and an override on the
    same command line fixes it."""
    result = nxdt("stages=[training]", f"training=@{NEMO_5B}", "cluster_type=slurm", "--dry-run",
                  f"base_results_dir={tmp_path}/r", cwd=tmp_path)
    assert result.returncode == 2
    assert "error: training.model.tokenizer.library: 'megatron' is not one of huggingface" in result.stderr
    text = NEMO_5B.read_text().replace("  fp8: False", "  fp8: True")
    (tmp_path / "fp8.yaml").write_text(text)
    result = nxdt("stages=[training]", f"training=@{tmp_path}/fp8.yaml", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert f"error: training=@{tmp_path}/fp8.yaml: model.fp8 True is not supported (fp8 is not supported)" \
        in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8.yaml"]


def test_the_documented_nemo_command_runs(tmp_path):
    command = ("nxdt-launch stages=[training] training=@tests/fixtures/nemo/gpt3_5b.yaml "
               "training.model.tokenizer.library=huggingface "
               "'training.model.tokenizer.model=${data_dir}/the_pile_gpt2/tokenizer.json' cluster_type=slurm --dry-run")
    assert command in (REPO / "docs" / "launcher.md").read_text()
    import shlex

    result = nxdt(*shlex.split(command)[1:], f"base_results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "gpt3_5b" / "training" / "training.sbatch").is_file()


def test_file_names_values_and_broken_config_json(tmp_path):
    """A file name Hydra could not parse as a choice; nulls and quotes in cluster values; a config.json with a
    value of the wrong type: each ends as the user would expect, never as a traceback."""
    text = (FIXTURES / "hf_llama3_8B_config.yaml").read_text()
    odd = tmp_path / "llama(8b), v2.yaml"
    odd.write_text(text.replace("compiler_cache_url: /home/ubuntu/neuron_cache", "compiler_cache_url: null")
                   .replace("compiler_flags: '--model-type transformer'", "compiler_flags: \"--flag 'quoted'\""))
    plan, training = _training(tmp_path, f"training=@{odd}")
    neuron = plan.cfg["cluster"]["neuron"]
    assert neuron["compiler_flags"] == "--flag 'quoted'"
    assert neuron["compile"]["cache"] == "/fsx/neuron-compile-cache"  # null: the cluster's own default stays
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({**json.loads((FIXTURES / "llama3_8b_config.json").read_text()),
                                  "num_attention_heads": 0}))
    with pytest.raises(UserError) as caught:
        launch.make_plan([*COMMON, f"base_results_dir={tmp_path}", f"training=@{FIXTURES}/hf_llama3_8B_config.yaml",
                          f"training.model.model_config={broken}"], dry_run=False, produced_by="test")
    assert any(line.startswith("training.model.model_config: ") for line in caught.value.problems)


def test_fractions_of_an_epoch_are_refused(tmp_path):
    file = tmp_path / "epochs.yaml"
    file.write_text((FIXTURES / "hf_llama3_8B_config.yaml").read_text().replace(
        "val_check_interval: 10001", "val_check_interval: 0.25"))
    result = nxdt(f"training=@{file}", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert "trainer.val_check_interval: 0.25 is a fraction of an epoch" in result.stderr


def test_explain_config_shows_what_the_base_recipe_supplies(tmp_path):
    result = nxdt("explain-config", str(FIXTURES / "hf_llama3_8B_config.yaml"), cwd=tmp_path)
    flat = " ".join(result.stdout.split())
    assert "(not in the file) run.preemption_signal_s" in flat.replace("│ ", "").replace(" │", "")


def _nxd_cp_file(tmp_path, size: int = 2):
    """NxD Training's hf_llama3_70B_CP_config.yaml: its hf_llama3_70B_config.yaml with context_parallel_size 2 and
    ring attention in place of flash attention (the published file differs from it in nothing else)."""
    text = (FIXTURES / "hf_llama3_70B_config.yaml").read_text()
    for old, new in (("  context_parallel_size: 1", f"  context_parallel_size: {size}"),
                     ("    flash_attention: True", "    flash_attention: False\n    ring_attention: True")):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "hf_llama3_70B_CP_config.yaml"
    path.write_text(text)
    return path


def test_nxd_context_parallel_file_renders_our_context_parallel_recipe(tmp_path):
    """distributed_strategy.context_parallel_size maps onto model.context_parallel_size: NxD's published CP file is
    the layout of training=llama3/70b_cp (NxD's data-parallel size, world / (tp x pp x cp), is our dp / cp)."""
    plan, ours = _training(tmp_path, f"training=@{_nxd_cp_file(tmp_path)}")
    _, theirs = _training(tmp_path, "training=llama3/70b_cp")
    for key in (*LAYOUT, "context_parallel_size", "activations_checkpoint_granularity"):
        assert ours["model"][key] == theirs["model"][key], (key, ours["model"][key], theirs["model"][key])
    assert ours["model"]["context_parallel_size"] == 2
    for key in ("num_nodes", "devices", "accelerator", "max_steps"):
        assert ours["trainer"][key] == theirs["trainer"][key], key
    (script,) = launch.write(plan)
    assert "#SBATCH --nodes=16" in script.read_text()
    result = nxdt("explain-config", str(_nxd_cp_file(tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.replace("│", " ").split())
    assert "distributed_strategy.context_parallel_size 2 training.model.context_parallel_size" in flat
    assert "ignored: kernel fusions are the backend's choice" in flat  # fusions.ring_attention: what cp > 1 runs


def test_nxd_context_parallel_size_the_layout_cannot_carve_is_refused(tmp_path):
    """The schema's long-context rules run on the mapped file: CP must divide the data-parallel size (2 here)."""
    with pytest.raises(UserError) as caught:
        _training(tmp_path, f"training=@{_nxd_cp_file(tmp_path, size=4)}")
    assert any("training.model.context_parallel_size: 4 must divide the data-parallel size 2" in problem
               for problem in caught.value.problems), caught.value.problems


def test_nemo_overlap_switches_map_to_megatron_core_names(tmp_path, recipe_data_dir):
    """NeMo's distributed optimizer's overlap_grad_sync / overlap_param_sync: a false turns the runtime's overlap
    off (model.overlap_grad_reduce / overlap_param_gather); a true is the runtime's default and changes nothing."""
    text = NEMO_5B.read_text().replace("overlap_grad_sync: True", "overlap_grad_sync: False")
    (tmp_path / "no_overlap.yaml").write_text(text)
    common = ["stages=[training]", "cluster_type=slurm", f"base_results_dir={tmp_path}/r", f"data_dir={recipe_data_dir}",
              *HF_TOKENIZER]
    model = launch.make_plan([*common, f"training=@{tmp_path}/no_overlap.yaml"], dry_run=True,
                             produced_by="test").cfg["training"]["model"]
    assert model["overlap_grad_reduce"] is False and "overlap_param_gather" not in model


def test_nemo_kv_channels_is_the_head_size(tmp_path, recipe_data_dir):
    """NeMo's model.kv_channels is Megatron's head size, ours too: null (hidden_size / num_attention_heads) and a
    number of its own both carry over, and the estimate sizes attention by it."""
    rows = {key: (value, what) for key, value, what in nxdt_config.map_file(str(NEMO_5B)).rows}
    assert rows["model.kv_channels"] == (None, "training.model.kv_channels")
    file = tmp_path / "kv_channels.yaml"
    file.write_text(NEMO_5B.read_text().replace("  kv_channels: null", "  kv_channels: 64"))
    plan = launch.make_plan(["stages=[training]", "cluster_type=slurm", f"base_results_dir={tmp_path}/r",
                             f"data_dir={recipe_data_dir}", f"training=@{file}", *HF_TOKENIZER], dry_run=True,
                            produced_by="test")
    training = plan.cfg["training"]
    assert training["model"]["kv_channels"] == 64 and training["model"]["hidden_size"] == 4096
    shape = estimate(training).shape
    assert (shape.head_dim, shape.query_size) == (64, 32 * 64)
