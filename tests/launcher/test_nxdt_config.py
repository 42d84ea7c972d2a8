"""NxD Training's published example configs (tests/fixtures/nxdt: their keys and values, comments dropped; its
README names each file's release and commit) run through `nxdt-launch training=@FILE --dry-run` unchanged and
render the layout of our own recipes (or, for the megatron files, the file's own layout and model); what we cannot
honour is refused in one line per key, before anything is written."""

import json
import shutil

import pytest
import yaml

from launcher import launch, nxdt_config
from launcher.errors import UserError
from launcher.estimator import estimate
from runtime.schema.choices import RECOMPUTE_MODULES
from runtime.schema.training import parse_training

from .helpers import REPO, edited_copy, nxdt

FIXTURES = REPO / "tests" / "fixtures" / "nxdt"
COMMON = ["stages=[training]", "cluster=pcluster_trn1", "cluster_type=slurm", "data_dir=/data"]

# NxD file -> (our recipe, the Hugging Face config.json its model_config names, facts of the published model)
PUBLISHED = {
    "hf_llama3_8B_config": ("llama3/8b", "llama3_8b_config.json"),
    "hf_llama3_70B_config": ("llama3/70b", "llama3_70b_config.json"),
    "hf_llama3.1_8B_config": ("llama3_1/8b", "llama3_1_8b_config.json"),
    "hf_llama3.1_70B_config": ("llama3_1/70b", "llama3_1_70b_config.json"),
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
    # Positions and RoPE scaling are config.json's (a contradicting YAML key is refused).
    published = json.loads((FIXTURES / config_json).read_text())
    assert ours_cfg.model.max_position_embeddings == published["max_position_embeddings"]
    assert (ours_cfg.model.rope_scaling is None) == (published.get("rope_scaling") is None)
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
    # NxD trains on data.seq_length; its model's encoder_seq_length (8192) only sized the positions, which
    # model_config's config.json decides here (the file's max_position_embeddings is not carried over).
    assert (model["encoder_seq_length"], model["data"]["seq_length"], model["max_position_embeddings"]) == \
        (4096, 4096, None)
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


def test_nxd_lora_at_tp_32_runs_over_replicated_kv_heads(tmp_path):
    """NxD runs LoRA on Llama 3 8B at TP 32 with its 8 KV heads replicated (kv_replicator 4), adapters on q, k and v:
    with the model's config.json read, the schema takes it as it is (one adapter per real KV head, its 4 copies
    kept one: tests/fine_tuning/test_lora_replicated_kv.py)."""
    config = f"peft.model.model_config={FIXTURES / 'llama3_8b_config.json'}"
    _, ours = _stage(tmp_path, "peft", f"peft=@{LORA}", config)
    assert ours["model"]["tensor_model_parallel_size"] == 32
    assert ours["model"]["peft"]["target_modules"] == ["qkv_proj"]  # NxD's name for q, k and v


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
    same file with dropless true, capacity_factor 0.0 and a relative compile cache), with `replace`'s lines swapped
    in."""
    name = "hf_mixtral_8x7b_dropless_config.yaml" if dropless else "hf_mixtral_8x7b_config.yaml"
    return edited_copy(FIXTURES / name, tmp_path, replace)


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
    for key in (*SHAPE, "moe"):
        assert getattr(ours_cfg.model, key) == getattr(theirs_cfg.model, key), key
    # The RoPE table is config.json's length (the file's ${.encoder_seq_length} is not carried over with a
    # model_config); rows of 4096 compute the same with either.
    assert ours_cfg.model.max_position_embeddings == MIXTRAL_8X7B_CONFIG["max_position_embeddings"] == 32768
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
                "model.rope_theta", "training.model.model_config_overrides.rotary_base", "compiler_cache_url",
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
    # ...and its document masking (reset_position_ids / reset_attention_mask), which our recipe leaves out.
    assert differ - {"model.data.reset_position_ids", "model.data.reset_attention_mask"} == \
        {"model.data.data_prefix", "run.dependency"}, differ
    assert theirs["run.dependency"] == "singleton" and len(theirs["model.data.data_prefix"]) == 60
    assert any("30 of 30 datasets are missing" in w for w in plan.warnings)  # a dry run only warns
    assert any("NeMo keys ignored" in w for w in plan.warnings)


def test_nemo_launcher_file_names_what_is_left_to_fix(tmp_path):
    """Its Megatron tokenizer (vocab_file + merge_file, GPT-2's BPE) is read as the tokenizer.json beside vocab_file
    (launcher/nemo_config.py), which a dry run only warns is not there yet; fp8 is refused in one line."""
    result = nxdt("stages=[training]", f"training=@{NEMO_5B}", "cluster_type=slurm", "--dry-run",
                  f"base_results_dir={tmp_path}/r", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"training.model.tokenizer.model: {tmp_path}/data/bpe/tokenizer.json does not exist" in \
        " ".join((result.stdout + result.stderr).split())
    shutil.rmtree(tmp_path / "r")
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
    return edited_copy(FIXTURES / "hf_llama3_70B_config.yaml", tmp_path,
                       {"  context_parallel_size: 1": f"  context_parallel_size: {size}",
                        "    flash_attention: True": "    flash_attention: False\n    ring_attention: True"},
                       name="hf_llama3_70B_CP_config.yaml")


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


# NxD Training 2.26.0's megatron examples (model_source: megatron): the model's shape and architecture are keys of
# the file, and the data is Megatron indexed data, as ours. File -> (the stage it configures, our architecture).
MEGATRON = {
    "megatron_gpt_config": ("training", "gpt"),
    "megatron_llama_7B_config": ("training", "llama"),
    "megatron_llama_70b_config": ("training", "llama"),
    "megatron_mistral_config": ("training", "llama"),
    "megatron_mixtral_8x7b_config": ("training", "llama"),
    "megatron_mixtral_8x7b_dropless_config": ("training", "llama"),
    "megatron_llama2_7B_SFT_config": ("fine_tuning", "llama"),
}
# What each of our architectures is, in the megatron switches (runtime/families/gpt, llama):
# normalization, position_embedding_type, activation, has_bias.
SWITCHES = {"gpt": ("layernorm", "learned_absolute", "gelu", True), "llama": ("rmsnorm", "rope", "swiglu", False)}
# megatron_gpt_config.yaml is refused as published for its schedule (test below): the layout tests run it with
# constant_steps 0, as its 80000 constant steps exceed its 20000 steps.
GPT_SCHEDULE = "training.model.optim.sched.constant_steps=0"


def _published(tmp_path, name, **replace):
    """A fixture file as published, or with `replace`'s lines swapped in (written to tmp_path)."""
    file = FIXTURES / f"{name}.yaml"
    return edited_copy(file, tmp_path, replace) if replace else file


def _megatron(tmp_path, name, *overrides):
    """The file's plan and stage config, dry run, and the file's own keys (resolved as NxD resolves them)."""
    stage, _ = MEGATRON[name]
    gpt = name == "megatron_gpt_config"
    file = _published(tmp_path, name)
    plan, ours = _stage(tmp_path, stage, f"{stage}=@{file}", *([GPT_SCHEDULE] if gpt else []), *overrides)
    nxd, _ = nxdt_config.load(str(file))
    return plan, ours, nxd


def _canonical(modules):
    return [RECOMPUTE_MODULES.canonical(m) for m in modules or []]


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_megatron_file_dry_runs_with_its_own_layout(name, tmp_path):
    """Each key of the layout, the batch, precision, schedule length and recompute is the file's; so is the model:
    its architecture switches, KV heads, shape and dropout; NxD's vocabulary padding (x TP) is kept."""
    stage, architecture = MEGATRON[name]
    plan, ours, nxd = _megatron(tmp_path, name)
    strategy, data, model = nxd["distributed_strategy"], nxd["data"], nxd["model"]
    for key in ("num_nodes", "devices", "max_steps"):
        assert ours["trainer"][key] == nxd["trainer"][key], key
    assert ours["trainer"]["accelerator"] == "neuron" and ours["precision"]["type"] == nxd["precision"]["type"]
    ours_model = ours["model"]
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel", "zero1"):
        assert ours_model[key] == strategy[key], key
    assert strategy["virtual_pipeline_model_parallel_size"] == 1 and \
        ours_model["virtual_pipeline_model_parallel_size"] is None  # NxD's 1: no interleaving
    assert ours_model["context_parallel_size"] == strategy.get("context_parallel_size", 1) == 1
    assert ours_model["expert_model_parallel_size"] == strategy.get("expert_model_parallel_size", 1) == 1
    assert (ours_model["micro_batch_size"], ours_model["global_batch_size"]) == \
        (data["micro_batch_size"], data["global_batch_size"])
    assert ours_model["encoder_seq_length"] == ours_model["data"]["seq_length"] == data["seq_length"]
    assert ours_model["activations_checkpoint_granularity"] == model["activations_checkpoint_granularity"]
    assert _canonical(ours_model["activations_checkpoint_recompute"]) == \
        _canonical(model["activations_checkpoint_recompute"])
    # The architecture: the file's four switches are one of ours.
    assert ours_model["architecture"] == architecture
    assert SWITCHES[architecture] == tuple(model[k] for k in ("normalization", "position_embedding_type",
                                                              "activation", "has_bias"))
    assert ours_model["num_query_groups"] == model["num_kv_heads"]
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings",
                "share_embeddings_and_output_weights", "hidden_dropout", "attention_dropout", "init_method_std",
                "layernorm_epsilon"):
        assert ours_model[key] == model[key], key
    assert ours_model.get("ffn_dropout", 0) == model.get("ffn_dropout", 0)  # megatron_gpt_config's 0.1
    assert ours_model["make_vocab_size_divisible_by"] == \
        model["make_vocab_size_divisible_by"] * strategy["tensor_model_parallel_size"]
    for key, value in (model.get("moe") or {}).items():
        if key not in ("dropout", "routing_algorithm", "sinkhorn_iterations", "sinkhorn_tol", "output_router_logits"):
            assert ours_model["moe"][key] == value, key
    # The data and tokenizer it names: not on this machine, which a dry run only warns of.
    tokenizer = data["tokenizer"]
    directory = tokenizer["vocab_file"].rsplit("/", 1)[0] if tokenizer["type"] == "GPT2BPETokenizer" else \
        tokenizer["type"]  # GPT-2's BPE: the tokenizer.json beside vocab_file
    expected = f"{directory}/tokenizer.json"
    assert ours_model["tokenizer"] == {"library": "huggingface", "model": expected}
    assert any(w.startswith(f"{stage}.model.tokenizer.model: {expected} does not exist") for w in plan.warnings)
    if stage == "training":
        assert ours_model["data"]["data_prefix"] == data["data_prefix"]
        assert ours_model["data"]["splits_string"] == data["splits_string"]
        assert any(w.startswith("training.model.data.data_prefix: ") for w in plan.warnings)
    else:  # the SFT file: chat files and starting weights, as NxD's hf SFT file
        assert ours_model["data"]["train_ds"]["file_names"] == [data["train_dir"]]
        assert ours_model["data"]["packing"] is True and ours_model["data"]["data_prefix"] is None
        assert ours_model["restore_from_path"] == nxd["exp_manager"]["resume_from_checkpoint"]
    (script,) = launch.write(plan)
    text = script.read_text()
    assert "--nproc_per_node 32" in text and f"#SBATCH --nodes={nxd['trainer']['num_nodes']}" in text
    assert nxd["compiler_flags"] in text


@pytest.mark.parametrize("name", [n for n, (stage, _) in sorted(MEGATRON.items()) if stage == "training"])
def test_megatron_file_builds_the_model_it_describes(name, tmp_path, recipe_data_dir):
    """With a tokenizer of the real size, the schema builds the file's model: GQA as num_kv_heads says, the vocabulary
    padded as NxD pads it (GPT-2's 50257 tokens to 50304 at TP 8, a multiple of 8 x 8)."""
    tokenizer = "the_pile_gpt2" if name == "megatron_gpt_config" else "llama2"
    _, ours, nxd = _megatron(tmp_path, name,
                             f"training.model.tokenizer.model={recipe_data_dir}/{tokenizer}/tokenizer.json",
                             f"training.model.data.data_prefix={recipe_data_dir}/{tokenizer}/blend.txt")
    cfg, report = parse_training(ours, files="error")
    assert report.errors == [] and cfg is not None, report.errors
    model = nxd["model"]
    assert (cfg.model.architecture, cfg.model.kv_heads, cfg.model.num_layers) == \
        (MEGATRON[name][1], model["num_kv_heads"], model["num_layers"])
    assert cfg.model.vocab_size == (50304 if tokenizer == "the_pile_gpt2" else 32000)
    assert (cfg.model.moe is None) == ("moe" not in model)
    if cfg.model.moe is not None:
        assert (cfg.model.moe.router_activation, cfg.model.moe.top_k) == ("sigmoid", 2)


def test_megatron_gpt_file_runs_as_published(tmp_path):
    """Its dropout inside the MLP (ffn_dropout 0.1) is built; its schedule (80000 constant steps in 20000) holds
    min_lr after the warmup as NeMo's does, with a warning (tests/launcher/test_nxdt_release.py)."""
    _, training = _training(tmp_path, f"training=@{FIXTURES / 'megatron_gpt_config.yaml'}")
    assert training["model"]["ffn_dropout"] == 0.1


@pytest.mark.parametrize("replace,expected", [
    ({"  activation: 'swiglu'": "  activation: 'gelu'"},
     "model.{normalization, position_embedding_type, activation, has_bias}: rmsnorm, rope, gelu, False is no "
     "architecture built here: gpt (layernorm, learned_absolute, gelu, True) or llama (rmsnorm, rope, swiglu, False)"),
    ({"  has_bias: False": "  has_bias: False\n  sliding_window_size: 1024"},
     "model.sliding_window_size: 1024: a megatron model here attends to the whole sequence (sliding windows are "
     "built only in the families whose config.json has them); a window below the sequence length (4096) changes the "
     "attention: set it to null"),
    ({"    library: 'huggingface'": "    library: 'sentencepiece'"},
     "data.tokenizer.library: 'sentencepiece' is not read here"),
    ({"  data_impl: mmap": "  data_impl: lazy"},
     "data.data_impl is not supported: Megatron's mmap indexed format is the one read; set it to mmap"),
    ({"  transformer_block_type: 'pre_ln'": "  transformer_block_type: 'post_ln'"},
     "model.transformer_block_type is not supported: only pre-norm blocks (pre_ln) are built"),
    ({"  eod_mask_loss: False": "  eod_mask_loss: True"},
     "data.eod_mask_loss is not supported: the end-of-document token is always trained on"),
    ({"    vocab_file: null": "    vocab_file: /data/gpt2-vocab.json"},
     "data.tokenizer.vocab_file is read only with data.tokenizer.type: GPT2BPETokenizer"),
])
def test_megatron_keys_we_cannot_honour_are_refused_one_line_each(replace, expected, tmp_path):
    file = _published(tmp_path, "megatron_llama_7B_config", **replace)
    with pytest.raises(UserError) as caught:
        _training(tmp_path, f"training=@{file}")
    problems = caught.value.problems
    assert len(problems) == 1 and problems[0].startswith(f"training=@{file}: {expected}"), problems
    assert sorted(p.name for p in tmp_path.iterdir()) == [file.name]


def test_megatron_sliding_window_as_long_as_the_sequence_changes_nothing(tmp_path):
    """megatron_mistral_config.yaml's window (4096) covers its whole sequence (4096): accepted."""
    rows = {key: what for key, _, what in nxdt_config.map_file(str(FIXTURES / "megatron_mistral_config.yaml")).rows}
    assert rows["model.sliding_window_size"] == "the default here: no sequence is longer than the window"


def test_explain_config_shows_the_megatron_mapping(tmp_path):
    rows = {key: (value, what) for key, value, what in
            nxdt_config.map_file(str(FIXTURES / "megatron_gpt_config.yaml")).rows}
    assert rows["(implied) model.{normalization, position_embedding_type, activation, has_bias}"] == \
        ("layernorm, learned_absolute, gelu, True", "training.model.architecture = 'gpt'")
    assert rows["model.num_kv_heads"] == (32, "training.model.num_query_groups")
    assert rows["data.data_prefix"][1] == "training.model.data.data_prefix"
    assert rows["data.tokenizer.type"] == ("GPT2BPETokenizer", "with vocab_file and merge_file: "
                                          "training.model.tokenizer.model = '/home/ubuntu/examples_datasets/gpt2/"
                                          "tokenizer.json'")
    assert rows["model.apply_query_key_layer_scaling"][1].startswith("ignored: a no-op in bf16 and fp32")
    assert rows["(implied) model.make_vocab_size_divisible_by x tensor_model_parallel_size"][0] == "8 x 8"
    assert rows["model.ffn_dropout"] == (0.1, "training.model.ffn_dropout")


# NxD Training 2.26.0's DPO example: the section moved to model_alignment_strategy.dpo and max_dpo_prompt_length
# was renamed max_prompt_length (Neuron 2.23); the older file is hf_llama3_8B_DPO_config.yaml.
DPO_2_26 = FIXTURES / "hf_llama3_8B_DPO_config_2_26.yaml"


def test_nxd_dpo_file_of_2_26_is_the_older_files_run(tmp_path):
    """Both spellings give the same alignment config, key for key; only the compiler flags changed upstream."""
    old_plan, old = _stage(tmp_path, "alignment", f"alignment=@{FIXTURES / 'hf_llama3_8B_DPO_config.yaml'}")
    plan, new = _stage(tmp_path, "alignment", f"alignment=@{DPO_2_26}")
    assert new == old
    assert new["model_alignment_strategy"]["dpo"]["max_dpo_prompt_length"] == 2048
    assert plan.cfg["cluster"]["neuron"]["compiler_flags"] == "--model-type transformer"
    assert old_plan.cfg["cluster"]["neuron"]["compiler_flags"] == \
        "--model-type transformer --distribution-strategy=llm-training"


def test_nxd_dpo_prompt_limit_under_both_names_must_agree(tmp_path):
    file = _published(tmp_path, "hf_llama3_8B_DPO_config_2_26",
                      **{"    max_prompt_length: 2048": "    max_prompt_length: 2048\n    max_dpo_prompt_length: 1024"})
    with pytest.raises(UserError) as caught:
        _stage(tmp_path, "alignment", f"alignment=@{file}")
    assert caught.value.problems == [
        f"alignment=@{file}: model_alignment_strategy.dpo: max_prompt_length (2048) and its older name "
        f"max_dpo_prompt_length (1024) disagree; keep one"]


@pytest.mark.parametrize("name,cache", [("hf_mixtral_8x7b_dropless_config", "neuron_cache_hf_moe"),
                                        ("megatron_mixtral_8x7b_dropless_config", "neuron_cache")])
def test_relative_compile_cache_goes_under_base_results_dir(name, cache, tmp_path):
    """NxD resolves a relative compiler_cache_url in the job's working directory; here the cache must be one
    directory every node sees, so it is <base_results_dir>/<path>, shared by the nodes and by later runs, and said."""
    plan, _ = _training(tmp_path, f"training=@{FIXTURES / name}.yaml")
    assert plan.cfg["cluster"]["neuron"]["compile"]["cache"] == f"{tmp_path}/{cache}"
    assert any(f"compiler_cache_url: '{cache}' is relative" in w and f"<base_results_dir>/{cache}" in w
               for w in plan.warnings)
    (script,) = launch.write(plan)
    assert f"export NEURON_COMPILE_CACHE_URL={tmp_path}/{cache}/" in script.read_text()
    # The user's own choice on the same command line wins.
    plan, _ = _training(tmp_path, f"training=@{FIXTURES / name}.yaml", "cluster.neuron.compile.cache=/fsx/cache")
    assert plan.cfg["cluster"]["neuron"]["compile"]["cache"] == "/fsx/cache"


@pytest.mark.parametrize("strategy, stage, shard", [("full", 3, None), ("grad", 2, None), ("hybrid", 3, 8)])
def test_nemo_fsdp_becomes_our_zero_stage(tmp_path, recipe_data_dir, strategy, stage, shard):
    """NeMo's model.fsdp with its sharding strategy: full shards the weights (ZeRO-3), grad the gradients and
    optimizer state (ZeRO-2), hybrid the weights within a node's 8 data-parallel ranks (TP 1), replicated across."""
    source = edited_copy(NEMO_5B, tmp_path, {"  fsdp: False": "  fsdp: True",
                                             "fsdp_sharding_strategy: 'full'": f"fsdp_sharding_strategy: '{strategy}'"})
    plan = launch.make_plan(["stages=[training]", "cluster_type=slurm", f"base_results_dir={tmp_path}/r",
                             f"data_dir={recipe_data_dir}", f"training=@{source}", *HF_TOKENIZER],
                            dry_run=True, produced_by="test")
    model = plan.cfg["training"]["model"]
    assert model["zero_stage"] == stage and model.get("data_parallel_shard_degree") == shard, model
