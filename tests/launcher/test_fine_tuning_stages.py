"""The fine_tuning (full-parameter SFT) and peft (LoRA) stages in the launcher: they compose, validate with the
training schema under their own names, render the trainer's job with --stage, chain after data_preparation and
training, and every recipe renders for its target in a dry run. Mistakes are one `error:` line each, exit code 2,
nothing written. The synthetic instruction data (data_preparation=sft_demo) is made by the data stage's own runner."""

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

from .helpers import REPO, nxdt, resolved

GIB = 2**30
FIXTURES = REPO / "tests" / "fixtures" / "nxdt"


def _plan(tmp_path: Path, *overrides: str, dry_run: bool = True, data_dir: Path | None = None) -> launch.Plan:
    return launch.make_plan([f"base_results_dir={tmp_path / 'results'}", f"data_dir={data_dir or tmp_path / 'data'}",
                             "cluster_type=slurm", *overrides], dry_run=dry_run, produced_by="test")


def _sft_demo_files(data: Path) -> None:
    """What data_preparation=sft_demo writes, as far as the launch looks at it."""
    folder = data / "sft_demo"
    folder.mkdir(parents=True)
    write_tokenizer(folder / "tokenizer.json", 512)
    # The demo's tokenizer carries its chat template (model.data.chat_template: null reads it, checked at launch).
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    record = {"messages": [{"role": "user", "content": "add: 1 + 2"}, {"role": "assistant", "content": "3"}]}
    for split in ("train", "valid", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps(record) + "\n")


def _demo_files(data: Path) -> None:
    """What data_preparation=demo writes, as far as the launch looks at it."""
    folder = data / "demo"
    folder.mkdir(parents=True)
    write_tokenizer(folder / "tokenizer.json", 4096)
    for suffix in (".idx", ".bin"):
        (folder / f"corpus{suffix}").write_bytes(b"")
    (folder / "blend.txt").write_text("1.0 corpus\n")


def test_stages_are_in_order_and_the_default_pipeline_is_unchanged():
    assert STAGES == ("data_preparation", "training", "fine_tuning", "peft", "alignment", "rlhf_rm", "rl", "conversion",
                      "evaluation")
    cfg = resolved()
    assert cfg["stages"] == ["data_preparation", "training", "conversion", "evaluation"]
    assert cfg["fine_tuning"]["run"]["name"] == "llama_tiny_sft" and cfg["peft"]["run"]["name"] == "llama_tiny_lora"


@pytest.mark.parametrize("stage", ["fine_tuning", "peft"])
def test_a_fine_tuning_stage_renders_the_trainer_with_its_stage(stage, tmp_path):
    plan = _plan(tmp_path, f"stages=[{stage}]")
    (script,) = launch.write(plan)
    text = script.read_text()
    run = "llama_tiny_sft" if stage == "fine_tuning" else "llama_tiny_lora"  # run_name: the stage's own run
    config = plan.jobs[0].config_path  # the launch's own (launches/<id>/), which <stage>_config.yaml links to
    assert (tmp_path / "results" / run / stage / f"{stage}_config.yaml").resolve() == config.resolve()
    assert f"-m runtime.train --config {config} --stage {stage}" in text
    # The same job as training's: torchrun over the stage's nodes, SIGUSR1 before the limit, requeue.
    assert "--nproc_per_node 2" in text and "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    assert f"{stage}.run.max_restarts is $MAX_RESTARTS" in text
    written = yaml.safe_load(config.read_text())
    assert written["model"]["data"]["train_ds"]["file_names"] == [f"{tmp_path}/data/sft_demo/train.jsonl"]
    assert written["model"]["restore_from_path"] is None
    assert (written["model"].get("peft") or {}).get("peft_scheme") == ("lora" if stage == "peft" else None)
    # The files are not there: warnings in a dry run, named by the stage's own keys.
    assert f"{stage}.model.data.train_ds.file_names: {tmp_path}/data/sft_demo/train.jsonl does not exist" in \
        " ".join(plan.warnings)


def test_data_preparation_makes_the_fine_tuning_inputs(tmp_path):
    """sft_demo writes the chat files and the tokenizer: a real launch does not look for them, and the data stage
    is one task that writes the synthetic set."""
    plan = _plan(tmp_path, "stages=[data_preparation,fine_tuning]", "data_preparation=sft_demo", dry_run=False)
    assert [w for w in plan.warnings if "sft_demo" in w] == []
    preparation, fine_tuning = plan.jobs
    assert (preparation.array_size, fine_tuning.stage) == (1, "fine_tuning")
    assert plan.cfg["data_preparation"]["input"]["source"] == "synthetic_instructions"
    assert plan.cfg["data_preparation"]["output_dir"] == f"{tmp_path}/data/sft_demo"


def test_a_data_preparation_that_makes_other_data_does_not_excuse_missing_inputs(tmp_path):
    """data_preparation=demo prepares a pretraining corpus: the fine-tuning files are still looked for."""
    with pytest.raises(UserError) as caught:
        _plan(tmp_path, "stages=[data_preparation,fine_tuning]", "data_preparation=demo", dry_run=False)
    assert any(p.startswith("fine_tuning.model.data.train_ds.file_names: ") and "does not exist" in p
               for p in caught.value.problems), caught.value.problems


def test_fine_tuning_restores_from_this_launchs_training(tmp_path):
    """restore_from_path at the training stage's checkpoints: they do not exist yet, and the launch goes on; the
    fine-tuning job waits for training (afterok) and reads the newest of them."""
    data = tmp_path / "data"
    _demo_files(data)
    _sft_demo_files(data)
    chained = ["stages=[training,fine_tuning]", "training=llama/tiny",
               "fine_tuning.model.restore_from_path=${training.run.results_dir}/checkpoints",
               "fine_tuning.model.tokenizer.model=${training.model.tokenizer.model}",
               "fine_tuning.model.data.chat_template=plain"]
    plan = _plan(tmp_path, *chained, dry_run=False)
    training, fine_tuning = plan.jobs
    assert fine_tuning.dependency == "afterok"
    assert fine_tuning.stage_config["model"]["restore_from_path"] == f"{training.results_dir}/checkpoints"
    # Without training in the launch, the same path is an input that must exist.
    with pytest.raises(UserError) as caught:
        _plan(tmp_path, *chained[1:], "stages=[fine_tuning]", dry_run=False)
    assert any(p.startswith("fine_tuning.model.restore_from_path: ") and "does not exist" in p
               for p in caught.value.problems), caught.value.problems


def test_the_written_stage_config_is_what_the_trainer_reads(tmp_path):
    data = tmp_path / "data"
    _sft_demo_files(data)
    for stage in ("fine_tuning", "peft"):
        plan = _plan(tmp_path, f"stages=[{stage}]", dry_run=False)
        launch.write(plan)
        written = yaml.safe_load(plan.jobs[0].config_path.read_text())
        cfg, report = parse_training(written, files="error", p=f"{stage}.")
        assert report.errors == [] and cfg is not None, report.errors
        assert cfg.sft.train_files == (f"{data}/sft_demo/train.jsonl",) and cfg.sft.packing
        assert cfg.model.vocab_size == 512
        assert (cfg.lora is not None) == (stage == "peft")
        if stage == "peft":
            assert cfg.lora.rank == 16 and "down_proj" in cfg.lora.target_modules


# recipe -> (the cluster config it is meant for, the device the estimator should pick for it)
def _intended(recipe: str) -> tuple[str, str]:
    if recipe.endswith("tiny"):
        return "slurm", "cpu"
    if recipe.endswith("_gpu"):
        return "slurm", "h100"
    return ("pcluster_trn2", "trn2") if recipe.endswith("_trn2") else ("pcluster_trn1", "trn1")


# hf/sft_demo has no model of its own: the directory it is given decides it (tests/fine_tuning/
# test_fine_tuning_pipeline.py runs it from a Qwen3 directory).
RECIPES = [(group, recipe) for group in ("fine_tuning", "peft") for recipe in group_choices(group)
           if not recipe.startswith("hf/")]
REAL_SIZE = [(group, recipe) for group, recipe in RECIPES if recipe != "llama/tiny"]
VOCAB = {"llama": 512, "llama3": 128256, "llama3_1": 128256, "mistral": 32768, "gemma3": 262144, "gpt_oss": 201088,
         "deepseek_v3": 129280}


def test_every_recipe_has_a_fine_tuning_and_a_lora_variant():
    assert group_choices("fine_tuning") == group_choices("peft")
    for family in ("gemma3", "gpt_oss", "deepseek_v3"):
        for size in {"gemma3": ("1b", "4b", "12b", "27b"), "gpt_oss": ("20b", "120b"), "deepseek_v3": ("671b",)}[family]:
            for target in ("", "_trn2"):
                assert f"{family}/{size}{target}" in group_choices("peft")
    for family in ("llama3", "llama3_1"):
        for size in ("8b", "70b"):
            for target in ("", "_trn2", "_gpu"):
                assert f"{family}/{size}{target}" in group_choices("peft")
    assert {"mistral/7b", "mistral/7b_trn2", "mistral/7b_gpu", "llama/tiny"} <= set(group_choices("peft"))


@pytest.mark.parametrize("group,recipe", RECIPES, ids=[f"{g}={r}" for g, r in RECIPES])
def test_recipe_dry_runs_and_fits(group, recipe, tmp_path):
    cluster, device = _intended(recipe)
    plan = _plan(tmp_path, f"stages=[{group}]", f"{group}={recipe}", f"cluster={cluster}", data_dir=Path("/data"))
    # Only the files this machine does not have (the weights, tokenizer and chat data of /data).
    assert [w for w in plan.warnings if "does not exist" not in w] == [], plan.warnings
    (script,) = launch.write(plan)
    stage = plan.cfg[group]
    trainer, model = stage["trainer"], stage["model"]
    text = script.read_text()
    assert f"--stage {group}" in text and f"#SBATCH --nodes={trainer['num_nodes']}" in text
    assert f"--nproc_per_node {trainer['devices']}" in text
    assert model["data"]["data_prefix"] is None and model["data"]["packing"] is True
    if recipe != "llama/tiny":
        assert model["restore_from_path"].startswith("/data/hf/") and trainer["accelerator"] != "cpu"
    if group == "peft" and recipe != "llama/tiny":
        # NxD Training's Llama-3 8B LoRA recipe, at a tp that keeps every KV head on one rank.
        assert model["peft"] == {"peft_scheme": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                                 "target_modules": ["qkv_proj"]}
        assert model["tensor_model_parallel_size"] <= (model["num_query_groups"] or model["num_attention_heads"])
    neuron = ((plan.cfg.get("cluster") or {}).get("neuron") or {}).get("hardware")
    result = estimate(copy.deepcopy(stage), neuron_hardware=neuron, node_memory_bytes=64 * GIB,
                      vocab_size=VOCAB[recipe.split("/")[0]], stage=group)
    assert result.hardware.name == device
    memory = result.memory
    if group == "peft":  # LoRA keeps no gradients or optimizer state for the frozen weights
        assert memory.gradients == memory.optimizer == 0, recipe
    assert memory.total <= result.hardware.usable_bytes, (recipe, memory.total / GIB,
                                                          result.hardware.usable_bytes / GIB)
    # Host memory per node, against the cluster's nodes (LoRA: the frozen weights alone).
    assert host_memory_problems(plan.cfg, group, vocab_size=VOCAB[recipe.split("/")[0]]) == []
    sched = model["optim"]["sched"]
    assert sched["warmup_steps"] + sched["constant_steps"] <= trainer["max_steps"]


# config.json of the models the recipes start from, as their publishers ship them (the keys the schema reads).
LLAMA3_8B = json.loads((FIXTURES / "llama3_8b_config.json").read_text())
LLAMA3_70B = json.loads((FIXTURES / "llama3_70b_config.json").read_text())
ROPE_3_1 = {"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "max_position_embeddings": 131072}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
              "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768}
# Gemma 3 as Hugging Face publishes it: 1B text-only (4.x's keys: sliding_window_pattern, rope_local_base_freq), the
# larger ones' text_config (their full RoPE scaled linearly by 8), saved as Gemma3ForCausalLM.
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
             "attention_dropout": 0.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
             "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
             "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 512,
             "sliding_window_pattern": 6, "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": [1, 106]}
GEMMA3_TEXT = {**GEMMA3_1B, "max_position_embeddings": 131072, "sliding_window": 1024, "vocab_size": 262208,
               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
GEMMA3 = {"1b": GEMMA3_1B,
          "4b": {**GEMMA3_TEXT, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                 "num_attention_heads": 8, "num_key_value_heads": 4},
          "12b": {**GEMMA3_TEXT, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                  "num_attention_heads": 16, "num_key_value_heads": 8},
          "27b": {**GEMMA3_TEXT, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                  "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168}}
# openai/gpt-oss-20b's config.json less its quantization_config (MXFP4, refused): a bf16 copy's; 120b is the same at
# 36 layers and 128 experts.
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
               "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
               "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
               "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
               "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
               "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
               "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
               "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
               "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
# deepseek-ai/DeepSeek-V3's config.json less its quantization_config (FP8, refused): a bf16 copy's.
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
               "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
               "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
               "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
               "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
               "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
               "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
               "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
               "vocab_size": 129280}
HF_MODELS = {"Meta-Llama-3-8B": (LLAMA3_8B, 128256), "DeepSeek-V3-bf16": (DEEPSEEK_V3, 129280), "Meta-Llama-3-70B": (LLAMA3_70B, 128256),
             "Llama-3.1-8B": ({**LLAMA3_8B, **ROPE_3_1}, 128256), "Llama-3.1-70B": ({**LLAMA3_70B, **ROPE_3_1}, 128256),
             "Mistral-7B-v0.3": (MISTRAL_7B, 32768), "gpt-oss-20b-bf16": (GPT_OSS_20B, 201088),
             "gpt-oss-120b-bf16": (GPT_OSS_120B, 201088),
             **{("gemma-3-1b-pt" if size == "1b" else f"gemma-3-{size}-text"): (config, 262144)
                for size, config in GEMMA3.items()}}
# Directories whose tokenizer_config.json holds the chat template their recipes read (model.data.chat_template null).
OWN_CHAT_TEMPLATE = {name for name in HF_MODELS if name.startswith(("gemma-3", "gpt-oss", "DeepSeek"))}
# What the schema does not compute yet (docs/fine_tuning.md, Limits): refused at launch, never trained wrong.
REFUSED: dict[str, str] = {}  # families whose published config.json the runtime cannot compute: none now


@pytest.fixture(scope="module")
def hf_data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_data")
    for name, (config, vocab) in HF_MODELS.items():
        (root / "hf" / name).mkdir(parents=True)
        (root / "hf" / name / "config.json").write_text(json.dumps(config))
        write_tokenizer(root / "hf" / name / "tokenizer.json", vocab)
        write_hf_weights(root / "hf" / name, config, vocab)
        if name in OWN_CHAT_TEMPLATE:
            (root / "hf" / name / "tokenizer_config.json").write_text(json.dumps(
                {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    (root / "sft").mkdir()
    for split in ("train", "validation"):
        (root / "sft" / f"{split}.jsonl").write_text('{"prompt": "1 + 2", "completion": "3"}\n')
    return root


@pytest.mark.parametrize("group,recipe", REAL_SIZE, ids=[f"{g}={r}" for g, r in REAL_SIZE])
def test_recipe_matches_the_model_it_restores(group, recipe, hf_data_dir, tmp_path):
    """With the published config.json and a tokenizer of the real vocabulary in place, every file check runs as at a
    real launch: the recipe's shape is the model's, and the vocabulary divides by its tp."""
    cluster, _ = _intended(recipe)
    stage = resolved(f"{group}={recipe}", f"cluster={cluster}", f"data_dir={hf_data_dir}")[group]
    cfg, report = parse_training(stage, files="error", p=f"{group}.")
    family = recipe.split("/")[0]
    if family in REFUSED:
        assert len(report.errors) == 1 and report.errors[0].startswith(f"{group}.model.restore_from_path: ")
        assert REFUSED[family] in report.errors[0]
    else:
        assert report.errors == [] and report.warnings == [], (report.errors, report.warnings)
        # The model built is the config.json's, to its context length (Llama 3.1: 131072, not Llama 3's 8192).
        config = HF_MODELS[Path(stage["model"]["restore_from_path"]).name][0]
        assert cfg.model.max_position_embeddings == config["max_position_embeddings"], recipe


DEVICE_MEMORY = [
    ("fine_tuning", "llama3/70b", "pipeline_model_parallel_size=1",
     "fine_tuning.model: weights, gradients and optimizer state need 16.3 GiB per device by the estimator, more than "
     "the 13.9 GiB usable on trn1.32xlarge NeuronCore-v2; raise tensor_model_parallel_size or "
     "pipeline_model_parallel_size, or shard them over data parallelism: zero_stage=1 (optimizer state), 2 (and "
     "gradients) or 3 (and weights)"),
    ("peft", "llama3/70b", "pipeline_model_parallel_size=1",
     "peft.model: weights (frozen under LoRA) need 16.4 GiB per device by the estimator"),
    ("alignment", "llama3/8b", "tensor_model_parallel_size=2",
     "alignment.model: weights, gradients and optimizer state need 25.2 GiB per device by the estimator"),
]


@pytest.mark.parametrize("group,recipe,change,expected", DEVICE_MEMORY, ids=[d[0] for d in DEVICE_MEMORY])
def test_device_memory_is_checked_in_every_trainer_stage(group, recipe, change, expected, hf_data_dir, tmp_path):
    """Fine-tuning, LoRA and alignment are sized by the estimator as training is (LoRA: frozen weights alone), so a
    layout whose state cannot fit a NeuronCore is refused before the queue wait, not at its first step. The nodes'
    host memory is stated large, so the device is what is judged."""
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={hf_data_dir}", "cluster=pcluster_trn1",
                  "cluster.node_memory_gib=4096", f"stages=[{group}]", f"{group}={recipe}", f"{group}.model.{change}",
                  "--dry-run", cwd=tmp_path)
    _one_error_line(result, expected)
    assert not list(tmp_path.iterdir()), "a rejected launch wrote files"


def test_mistral_is_llama3_8b_with_its_own_rope_and_vocabulary():
    mistral, llama = resolved("fine_tuning=mistral/7b")["fine_tuning"]["model"], \
        resolved("fine_tuning=llama3/8b")["fine_tuning"]["model"]
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        assert mistral[key] == llama[key], key
    assert (mistral["num_layers"], mistral["hidden_size"], mistral["num_attention_heads"], mistral["num_query_groups"],
            mistral["ffn_hidden_size"], mistral["rotary_base"]) == (32, 4096, 32, 8, 14336, 1e6)
    assert mistral["tokenizer"]["model"].endswith("/hf/Mistral-7B-v0.3/tokenizer.json")


# Mistakes: one `error:` line each, exit code 2, nothing written (run through the real CLI, as a user meets them).
def _hf_dir(root: Path, **changes) -> Path:
    """A Hugging Face directory whose config.json is llama/tiny's shape with `changes`."""
    folder = root / "hf_model"
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 512,
              "rope_theta": 10000.0, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    write_hf_weights(folder, config, 512)  # llama/tiny's weights: what the tests change is config.json
    return folder


BAD = [
    (["stages=[peft]", "peft.model.peft.target_modules=[qkv]"],
     "peft.model.peft.target_modules: 'qkv' is not a projection LoRA can adapt; did you mean 'qkv_proj'?"),
    (["stages=[peft]", "peft.model.peft.lora_rank=0"], "peft.model.peft.lora_rank: 0 must be a positive integer"),
    (["stages=[peft]", "peft.model.peft.peft_scheme=none"],
     "peft.model.peft.peft_scheme: null in the peft stage, which trains LoRA adapters; set "
     "peft.model.peft.peft_scheme=lora"),
    (["stages=[fine_tuning]", "+fine_tuning.model.peft.peft_scheme=lora"],
     "fine_tuning.model.peft.peft_scheme: 'lora' in the fine_tuning stage, which trains every weight; use the peft "
     "stage for LoRA"),
    (["stages=[fine_tuning]", "fine_tuning.model.data.data_prefix=/data/demo/blend.txt"],
     "fine_tuning.model.data: both data_prefix (pretraining) and train_ds (fine-tuning) are set"),
    (["stages=[peft]", f"peft=@{FIXTURES}/hf_llama3_8B_config.yaml"],
     "it pretrains, so it runs as the training stage: launch it with stages=[training] training=@"),
    (["stages=[data_preparation]", "data_preparation=sft_demo",
      "data_preparation.synthetic_instructions.vocab_size=100"],
     "data_preparation.synthetic_instructions.vocab_size: 100 must be an integer >= 300"),
    (["stages=[data_preparation]", "data_preparation=sft_demo", "+data_preparation.tokenizer.model=/x/tokenizer.json"],
     "data_preparation.tokenizer.model: input.source 'synthetic_instructions' writes its own tokenizer"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(overrides, expected, tmp_path):
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
                  *overrides, "--dry-run", cwd=tmp_path)
    _one_error_line(result, expected)
    assert not list(tmp_path.iterdir()), "a rejected launch wrote files"


def test_weights_of_another_model_are_refused_before_submitting(tmp_path):
    """A Hugging Face restore_from_path decides the model: a recipe key that says otherwise is refused at launch (and
    in a dry run) in one line naming both values; so is a config.json that our models cannot compute."""
    for changes, first_key, expected in (
            ({"hidden_size": 256, "rms_norm_eps": 1e-5}, "fine_tuning.model.hidden_size: ",
             "the YAML disagrees with {folder}/config.json (model.restore_from_path), which decides the model: "
             "hidden_size 128 (config.json: 256); drop the key (fine_tuning.model.hidden_size=null)"),
            # transformers' default rms_norm_eps for llama (1e-6) is config.json's when the key is absent.
            ({}, "fine_tuning.model.layernorm_epsilon: ", "layernorm_epsilon 1e-05 (config.json: 1e-06)"),
            # The context length is config.json's too: a shorter YAML one is refused, not trained silently.
            ({"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}, "fine_tuning.model.max_position_embeddings: ",
             "max_position_embeddings 2048 (config.json: 4096)"),
            ({"model_type": "mistral_moe"}, "fine_tuning.model.restore_from_path: ",
             "{folder}/config.json: config.json model_type='mistral_moe' is not supported"),
            ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "fine_tuning.model.restore_from_path: ",
             "config.json rope_type='dynamic' (rope_scaling / rope_parameters) is not supported; supported: default, "
             "linear, llama3, yarn")):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        root.mkdir()
        folder = _hf_dir(root, **changes)
        extra = ["fine_tuning.model.max_position_embeddings=2048"] if "max_position_embeddings" in changes else []
        result = nxdt(f"base_results_dir={root}/results", f"data_dir={root}/data", "cluster_type=local",
                      "stages=[fine_tuning]", f"fine_tuning.model.restore_from_path={folder}", *extra, "--dry-run",
                      cwd=root)
        _one_error_line(result, first_key)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert expected.format(folder=folder) in result.stderr, result.stderr
        assert sorted(p.name for p in root.iterdir()) == ["hf_model"], "a rejected launch wrote files"
    # A config.json that is not JSON, and a directory without its tokenizer at a real launch: the file and the key.
    root = tmp_path / "broken"
    folder = _hf_dir(root.mkdir() or root)
    (folder / "config.json").write_text('{"model_type": "llama",')
    result = nxdt(f"base_results_dir={root}/results", f"data_dir={root}/data", "cluster_type=local",
                  "stages=[fine_tuning]", "fine_tuning=hf/sft_demo", f"fine_tuning.model.restore_from_path={folder}",
                  "--dry-run", cwd=root)
    _one_error_line(result, f"fine_tuning.model.restore_from_path: {folder}/config.json: is not valid JSON")
    root = tmp_path / "no_tokenizer"
    folder = _hf_dir(root.mkdir() or root)
    _sft_demo_files(root / "data")
    result = nxdt(f"base_results_dir={root}/results", f"data_dir={root}/data", "cluster_type=local",
                  "stages=[fine_tuning]", "fine_tuning=hf/sft_demo", f"fine_tuning.model.restore_from_path={folder}",
                  cwd=root)
    _one_error_line(result, f"fine_tuning.model.tokenizer.model: {folder}/tokenizer.json does not exist")
    assert not (root / "results").exists()


# GPT-2's published config.json: 50257 tokens, which no power of two divides.
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_positions": 1024,
        "n_ctx": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "bos_token_id": 50256, "eos_token_id": 50256}


def _gpt2_dir(root: Path, weights_vocab: int = 50257) -> Path:
    folder = root / "gpt2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(GPT2))
    write_tokenizer(folder / "tokenizer.json", 50257)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    write_hf_weights(folder, {**GPT2, "vocab_size": weights_vocab}, weights_vocab)
    return folder


def test_gpt2s_vocabulary_is_padded_for_tp2_and_weights_of_another_are_refused(tmp_path):
    """fine_tuning=hf/sft_demo pads GPT-2's 50257 tokens to 50304 (make_vocab_size_divisible_by 128), which tp2
    splits: the dry run accepts it, and the model the launch builds reads the directory's 50257 rows (its weights
    were refused after launch for their shape). Weights whose rows are not config.json's vocab_size: one line at
    the dry run, nothing written."""
    from runtime.convert.hf import SlicedReader

    folder = _gpt2_dir(tmp_path)
    _sft_demo_files(tmp_path / "data")
    common = [f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
              "stages=[fine_tuning]", "fine_tuning=hf/sft_demo", "fine_tuning.model.tensor_model_parallel_size=2"]
    result = nxdt(*common, f"fine_tuning.model.restore_from_path={folder}", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rendered = yaml.safe_load((tmp_path / "results" / "hf_sft_demo" / "fine_tuning" / "fine_tuning_config.yaml")
                              .read_text())
    cfg, report = parse_training(rendered, files="error", p="fine_tuning.")  # as the job's ranks read it
    assert report.errors == [] and (cfg.model.vocab_size, cfg.model.unpadded_vocab_size) == (50304, 50257)
    SlicedReader(folder, cfg.model).check()  # the ranks' check of the weights' shapes, from the headers

    other = _gpt2_dir(tmp_path / "other", weights_vocab=50304)
    before = sorted(tmp_path.rglob("*"))
    result = nxdt(*common, f"fine_tuning.model.restore_from_path={other}", "--dry-run", cwd=tmp_path)
    _one_error_line(result, f"fine_tuning.model.restore_from_path: its transformer.wte.weight has 50304 rows but "
                            f"{other}/config.json has vocab_size 50257")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(tmp_path.rglob("*")) == before, "a rejected launch wrote files"


def test_a_missing_chat_file_is_an_error_at_a_real_launch(tmp_path):
    data = tmp_path / "data"
    _sft_demo_files(data)
    (data / "sft_demo" / "train.jsonl").unlink()
    before = sorted(tmp_path.rglob("*"))
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={data}", "cluster_type=local",
                  "stages=[fine_tuning]", cwd=tmp_path)
    _one_error_line(result, f"fine_tuning.model.data.train_ds.file_names: {data}/sft_demo/train.jsonl does not exist")
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(tmp_path.rglob("*")) == before, "a rejected launch wrote files"


@pytest.mark.parametrize("case", ["no assistant turn", "no chat template"])
def test_bad_records_and_a_missing_template_are_errors_at_launch(case, tmp_path):
    """What the job would find before its first step is found before it is queued: a record it cannot learn from
    (file:line), or a tokenizer with no chat template when model.data.chat_template is null."""
    data = tmp_path / "data"
    _sft_demo_files(data)
    if case == "no assistant turn":
        with open(data / "sft_demo" / "train.jsonl", "a") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": "add: 1 + 2"}]}) + "\n")
        expected = (f"fine_tuning.model.data.train_ds.file_names: {data}/sft_demo/train.jsonl:2: the record has no "
                    f"assistant message")
    else:
        (data / "sft_demo" / "tokenizer_config.json").write_text("{}")
        expected = "fine_tuning.model.data.chat_template: null uses the tokenizer's own template, but"
    before = sorted(tmp_path.rglob("*"))
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={data}", "cluster_type=local",
                  "stages=[fine_tuning]", cwd=tmp_path)
    _one_error_line(result, expected)
    assert sorted(tmp_path.rglob("*")) == before, "a rejected launch wrote files"


def _one_error_line(result, expected: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    assert any(expected in line for line in lines), result.stderr


# The data stage's synthetic source: one task, written by runtime.sft.synthetic, and found done when run again.
def test_sft_demo_is_one_task_that_writes_the_instruction_set(tmp_path):
    from runtime.data_prep.plan import check_inputs, count_tasks
    from runtime.data_prep.run import run_task
    from runtime.schema.data_preparation import parse_config

    stage = resolved(f"data_dir={tmp_path}", "data_preparation=sft_demo", stable=False)["data_preparation"]
    stage["synthetic_instructions"].update(num_train=60, num_valid=10, num_test=10)
    assert count_tasks(stage) == 1 and check_inputs(stage) == []
    cfg = parse_config(stage)
    assert cfg.tokenizer.model is None and cfg.synthetic_instructions.vocab_size == 512
    assert run_task(cfg, 0, 1) is True
    out = tmp_path / "sft_demo"
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "test.jsonl", "tokenizer.json",
                                                     "tokenizer_config.json", "train.jsonl", "valid.jsonl"]
    assert len((out / "train.jsonl").read_text().splitlines()) == 60
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run_task(cfg, 0, 1) is True  # already complete: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written


def test_a_model_whose_shape_is_not_here_is_not_estimated_and_not_a_traceback(tmp_path, monkeypatch):
    """hf/sft_demo from a Hugging Face directory that is not on this machine, its tokenizer named by a known path:
    the memory check cannot size the model (no config.json here) and says nothing, as the dry run goes on."""
    from launcher import launch

    monkeypatch.chdir(tmp_path)
    plan = launch.make_plan(["stages=[fine_tuning]", "fine_tuning=hf/sft_demo",
                             "fine_tuning.model.restore_from_path=/fsx/hf/qwen3-8b"], dry_run=True, produced_by="test")
    assert [job.stage for job in plan.jobs] == ["fine_tuning"] and plan.estimates == {}
