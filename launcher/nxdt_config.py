"""NxD Training YAML files as they are: `nxdt-launch training=@hf_llama3_8B_config.yaml` maps every key we
support onto our training keys (and the Neuron compiler keys onto cluster.neuron), names the keys it ignores as
warnings, and refuses the keys it cannot honour in one error. `nxdt-launch explain-config FILE` prints the mapping.

NxD Training fine-tunes and aligns from the same kind of file: with `model_alignment_strategy.dpo` or `orpo` it is
the alignment stage (`alignment=@FILE`; NxD's older DPO files keep the section under `data.alignment_strategy`), with
`model_alignment_strategy.peft` the peft stage (LoRA, `peft=@FILE`), with `model_alignment_strategy.sft` or
`model.weight_init_only` the fine_tuning stage (`fine_tuning=@FILE`); the stage a file is given as must be the one
it configures.

The result is registered as a Hydra config (<stage>=<name>) on top of the family's base recipe, so the user's own
overrides on the same command line still win and every rule of the schema runs on the result.
Pure apart from reading the file (and the config.json it points at): nothing is written.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher import config_file, nemo_config
from launcher.nemo_config import longest_prefix
from launcher.errors import UserError
from launcher.file_choices import is_file_choice, store_choice
from launcher.resolvers import register_resolvers
from runtime.schema.families import ARCHITECTURES, HF_BASE, megatron_architecture, megatron_choices

# NxD Training's preference-alignment keys, per strategy (model_alignment_strategy.<strategy>.<key>).
ALIGNMENT_KEYS = {"dpo": ("kl_beta", "loss_type", "max_dpo_prompt_length", "precompute_ref_log_probs",
                          "truncation_mode"),
                  "orpo": ("beta", "max_prompt_length", "truncation_mode")}
# Neuron 2.23 renamed DPO's max_dpo_prompt_length to max_prompt_length (ORPO's name); both spellings are read.
DPO_RENAMED = ("max_prompt_length", "max_dpo_prompt_length")

# NxD key -> our key under `training.` (or `cluster.` for the Neuron compiler keys). Same meaning, new place. A
# fine-tuning or alignment file's keys land under its own stage (fine_tuning., peft. or alignment.) instead.
MAPPED: dict[str, str] = {
    "name": "training.run.name",
    "seed": "training.model.seed",
    **{f"trainer.{k}": f"training.trainer.{k}" for k in (
        "devices", "num_nodes", "max_steps", "log_every_n_steps", "val_check_interval", "limit_val_batches",
        "gradient_clip_val")},
    **{f"exp_manager.{k}": f"training.exp_manager.{k}" for k in (
        "create_tensorboard_logger", "create_wandb_logger", "resume_if_exists", "create_checkpoint_callback",
        "resume_from_checkpoint")},
    **{f"exp_manager.checkpoint_callback_params.{k}": f"training.exp_manager.checkpoint_callback_params.{k}"
       for k in ("save_top_k", "every_n_train_steps", "save_last", "dirpath")},
    "exp_manager.async_checkpointing": "training.exp_manager.checkpoint_callback_params.async_save",
    # context_parallel_size: the same layout. NxD divides the world by tp x pp x cp for the ranks that read distinct
    # samples; here dp = world / (tp x pp) counts every replica and dp / cp of them read distinct samples, so a file's
    # micro-batches per step are the same. NxD's fusions.ring_attention (required with it) is what cp > 1 runs here.
    # NxD has no Ulysses key: ulysses_parallel_size is ours alone.
    **{f"distributed_strategy.{k}": f"training.model.{k}" for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "zero1", "sequence_parallel", "expert_model_parallel_size", "context_parallel_size")},
    "data.micro_batch_size": "training.model.micro_batch_size",
    "data.global_batch_size": "training.model.global_batch_size",
    "data.seq_length": "training.model.data.seq_length",
    "data.train_dir": "training.model.data.data_prefix",
    **{f"model.{k}": f"training.model.{k}" for k in (
        "model_config", "encoder_seq_length", "max_position_embeddings", "num_layers", "hidden_size",
        "ffn_hidden_size", "num_attention_heads", "num_query_groups", "init_method_std", "hidden_dropout",
        "attention_dropout", "ffn_dropout", "layernorm_epsilon", "make_vocab_size_divisible_by",
        "share_embeddings_and_output_weights", "activations_checkpoint_granularity",
        "activations_checkpoint_recompute")},
    "model.rope_theta": "training.model.rotary_base",
    # Mixture of experts: NxD's model.moe keys are the schema's own (runtime/schema/model.py MoEConfig).
    **{f"model.moe.{k}": f"training.model.moe.{k}" for k in (
        "num_experts", "top_k", "frequency", "capacity_factor", "dropless", "router_aux_loss_coef",
        "normalize_top_k_affinities", "router_activation")},
    "model.num_local_experts": "training.model.moe.num_experts",  # config.json's name for it
    **{f"model.optim.{k}": f"training.model.optim.{k}" for k in (
        "name", "lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov")},
    **{f"model.optim.sched.{k}": f"training.model.optim.sched.{k}" for k in (
        "name", "warmup_steps", "constant_steps", "min_lr", "max_steps")},
    "precision.type": "training.precision.type",
    "compiler_flags": "cluster.neuron.compiler_flags",
    "compiler_cache_url": "cluster.neuron.compile.cache",
    # Trn2: the logical NeuronCore config (2: 64 workers per trn2.48xlarge, 1: 128) and uneven pipeline stages.
    "trainer.lnc": "cluster.neuron.lnc",
    "model.pipeline_cuts": "training.model.pipeline_cuts",
    "aync_exec_max_inflight_requests": "cluster.neuron.async_exec_max_inflight_requests",  # NxD's own spelling
    "async_exec_max_inflight_requests": "cluster.neuron.async_exec_max_inflight_requests",
    # Fine-tuning: NxD's SFT packing and LoRA keys are the schema's own (model.data.packing, model.peft.*).
    "model_alignment_strategy.sft.packing": "training.model.data.packing",
    **{f"model_alignment_strategy.peft.{k}": f"training.model.peft.{k}" for k in (
        "lora_rank", "lora_alpha", "lora_dropout", "target_modules")},
    # Alignment: NxD's DPO and ORPO keys are the schema's own, in the same section (the alignment stage's
    # model_alignment_strategy.<strategy>); NxD's older DPO files keep it under data.alignment_strategy.
    **{f"{section}.{strategy}.{k}": f"training.model_alignment_strategy.{strategy}.{k}"
       for section in ("model_alignment_strategy", "data.alignment_strategy")
       for strategy, keys in ALIGNMENT_KEYS.items() for k in keys},
    **{f"{section}.dpo.{DPO_RENAMED[0]}": f"training.model_alignment_strategy.dpo.{DPO_RENAMED[1]}"
       for section in ("model_alignment_strategy", "data.alignment_strategy")},
    # NxD's megatron models (model_source: megatron) read Megatron-LM's data keys and name the model's shape as
    # NeMo does, which is how our schema names it.
    **{f"data.{k}": f"training.model.data.{k}" for k in (
        "data_prefix", "index_mapping_dir", "splits_string", "num_workers", "packing")},
    "model.num_kv_heads": "training.model.num_query_groups",
    "data.reset_position_ids": "training.model.data.reset_position_ids",
    "data.reset_attention_mask": "training.model.data.reset_attention_mask",
    "model.kv_channels": "training.model.kv_channels",
}

# The model keys NxD Training's Hugging Face models apply over model_config's config.json (their _get_model: "if
# self.config.model.get('num_layers', -1) != -1: config.num_hidden_layers = ..."): the file's explicit value is the
# user's intent (hf_llama_7B_config trains a 4-layer cut of Llama 2 7B), so it goes to
# model.model_config_overrides, which the schema applies over config.json and names in a warning.
OVER_CONFIG_JSON = {"model.num_layers": "num_layers", "model.hidden_size": "hidden_size",
                    "model.rope_theta": "rotary_base"}

# A fine-tuning file's data: NxD's SFT train_dir and val_dir are the chat files (one file or a list each); its
# weights: exp_manager.resume_from_checkpoint with model.weight_init_only: true (weights only, a fresh run).
FINE_TUNING_MAPPED = {
    "data.train_dir": "training.model.data.train_ds.file_names",
    "data.val_dir": "training.model.data.validation_ds.file_names",
}
WEIGHTS_FROM = "exp_manager.resume_from_checkpoint"

# PyTorch Lightning reads a float here as a fraction of an epoch (0.0: none); nxdt-launch counts steps/batches.
FRACTIONS = ("trainer.val_check_interval", "trainer.limit_val_batches")

# NxD Training's trainer.sequential_move_factor: how many ranks move the model to the device at once, which bounds
# host memory at start-up where every rank first builds the whole model on the host. Here every rank builds on the
# meta device and only ever materializes its own shard, so each holds only its shard on the host at every moment
# and moving in groups bounds nothing: accepted when it is a positive integer, as NxD requires, and it changes
# nothing (docs/launcher.md, Host memory).
SEQUENTIAL_MOVE_FACTOR = "trainer.sequential_move_factor"

# Keys whose effect nxdt-launch already has (or that only tune NxD's own implementation): ignoring them is safe.
IGNORED: dict[str, str] = {
    SEQUENTIAL_MOVE_FACTOR: "every rank holds only its own shard on the host (meta-device initialization), so "
                            "moving the model to the device in groups bounds nothing",
    "model_source": "the architecture comes from model_config (hf) or from the model's own keys (megatron)",
    "trainer.max_epochs": "training is step based (trainer.max_steps)",
    "trainer.check_val_every_n_epoch": "training is step based (trainer.val_check_interval)",
    "trainer.num_sanity_val_steps": "no sanity validation is run",
    "trainer.limit_test_batches": "the test split is scored by the evaluation stage",
    "exp_manager.log_local_rank_0_only": "only rank 0 logs",
    "exp_manager.explicit_log_dir": "logs go to the training stage's results directory",
    "exp_manager.exp_dir": "logs go to the training stage's results directory",
    "exp_manager.name": "the run is named by `name`",
    "exp_manager.resume_ignore_no_checkpoint": "resume_if_exists starts fresh when there is no checkpoint",
    "exp_manager.checkpoint_callback_params.monitor": "checkpoints are kept newest-first (save_top_k)",
    "exp_manager.checkpoint_callback_params.mode": "checkpoints are kept newest-first (save_top_k)",
    "exp_manager.checkpoint_callback_params.filename": "checkpoint directories are named step_<N>.<launch>",
    "exp_manager.checkpoint_callback_params.model_parallel_size": "derived from the layout",
    "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt": "checkpoints always hold what resume needs",
    "exp_manager.log_parameter_norm": "not logged",
    "exp_manager.log_gradient_norm": "the gradient norm is logged at every logged step",
    "exp_manager.enable_recovery_time_instrumentation": "not logged",
    "exp_manager.save_xser": "checkpoints use nxdt-launch's own sharded format",
    "exp_manager.load_xser": "checkpoints use nxdt-launch's own sharded format",
    "exp_manager.save_bf16": "checkpoints keep the training dtype",
    "distributed_strategy.kv_replicator": "KV heads are replicated to tensor_model_parallel_size automatically "
                                          "(LoRA adapters on k and v too: one per real KV head)",
    "model.qkv_linear": "QKV is one fused column-parallel linear",
    "model.fuse_qkv": "QKV is one fused column-parallel linear",
    "model.use_cpu_initialization": "weights are initialized on the host, then sharded",
    "model.fusions": "kernel fusions are the backend's choice",
    "model.optim.capturable": "an implementation detail of NxD's optimizer",
    "precision.master_weights": "set by precision.type (used only with type: manual)",
    "precision.fp32_grad_acc": "set by precision.type (used only with type: manual)",
    "precision.xla_use_bf16": "set by precision.type (used only with type: manual)",
    "precision.xla_downcast_bf16": "set by precision.type (used only with type: manual)",
    "precision.neuron_rt_stochastic_rounding_en": "set by precision.type (used only with type: manual)",
    "bucket_size_collectives": "collectives are bucketed by the runtime",
    "neuron_rt_exec_timeout": "the Neuron runtime's default applies",
    "neuron_experimental_compress_rg": "the Neuron runtime's default applies",
    "data.dev_choose_samples": "NxD's debugging subset of the data; every record of the data files is used",
    "exp_manager.ckpt_ptl_version": "checkpoints use nxdt-launch's own format",
    "model.transpose_nki_inputs": "a Neuron kernel detail",
    "precision.fp32_grads_cc": "gradients are reduced in fp32 in every precision type",
    "precision.parallel_layers_reduce_dtype": "tensor-parallel reductions run in the activations' dtype: bf16 under "
                                              "the bf16 precision types, fp32 under fp32",
    "data.val_dir": "pretraining validates on the validation split of data_prefix (splits_string)",
    "model_alignment_strategy.peft.lora_verbose": "the adapters are listed in the log",
    "model_alignment_strategy.peft.save_lora_base": "a LoRA run's checkpoints hold its adapters; the base weights are "
                                                    "model.restore_from_path, read again on resume",
    "model_alignment_strategy.peft.merge_lora": "the conversion stage exports a LoRA run merged or as a PEFT adapter "
                                                "(conversion.lora)",
    "model_alignment_strategy.peft.save_lora_config_adapter": "the conversion stage writes a PEFT adapter's "
                                                              "adapter_config.json (conversion.lora)",
    "model_alignment_strategy.peft.merge_sharded_lora": "checkpoints are resharded on load whatever the layout",
    "model.moe.sinkhorn_iterations": "used only by sinkhorn routing; routing here is top_k",
    "model.moe.sinkhorn_tol": "used only by sinkhorn routing; routing here is top_k",
    # A megatron file's keys that only pick NxD's implementation.
    "data.skip_warmup": "no page-cache warmup of the index files",
    "data.use_sft_style_data_module": "the fine_tuning stage reads chat files (data.train_dir)",
    "data.tokenizer.delimiter": "used by NeMo's tabular tokenizer only",
    "data.tokenizer.sentencepiece_legacy": "used by NeMo's SentencePiece tokenizer only; a tokenizer.json is read",
    "data.tokenizer.use_fast": "a tokenizer.json is read by Hugging Face tokenizers; slow and fast tokenize alike",
    "model.apply_query_key_layer_scaling": "a no-op in bf16 and fp32 (it guards fp16 overflow)",
    "model.persist_layer_norm": "a kernel choice",
}

# NxD Training's recompute modules with no module of that exact extent here: the nearest, and what differs (never
# the result: recomputing is exact; only memory and time move).
RECOMPUTE_NEAREST = {
    "ActivationMultiplyMLP": ("mlp", "recomputes the whole MLP here (NxD: its activation and multiply only): more "
                                     "compute, less activation memory"),
    "LlamaRMSNorm": (None, "norms are kept, not recomputed, here: more activation memory than NxD's (the "
                           "estimator counts it)"),
}

# Ignored, but it changes training a little: said as a warning that names the difference.
DIFFERS = {
    "model.do_layer_norm_weight_decay": (True, "nxdt-launch never applies weight decay to norm weights and biases "
                                               "(Megatron's choice), so this run differs slightly from NxD's"),
}

# What nxdt-launch cannot do yet: refused, with where it is heading.
UNSUPPORTED: dict[str, str] = {
    "model_alignment_strategy.peft.lora_bias": "trainable biases beside the adapters are not built; set it to none",
    "model_alignment_strategy.peft.load_lora_from_ckpt": "starting from saved adapters is not built (a peft run "
                                                         "resumes its own); set it to False",
    "distributed_strategy.token_shuffle_group_size": "shuffling tokens across data-parallel ranks before routing "
                                                     "is not built yet; set it to 1",
    "model.moe.routing_algorithm": "routing other than top_k (sinkhorn) is not built yet; set it to top_k",
    "model.moe.dropout": "dropout in the MoE layer is not built yet; set it to 0.0",
    # A megatron file's keys: what our data reader and models always do, and what they cannot do yet.
    "data.data_impl": "Megatron's mmap indexed format is the one read; set it to mmap",
    "data.dataloader_type": "cyclic sampling (a new shuffle each epoch) is not built; set it to single",
    "data.eod_mask_loss": "the end-of-document token is always trained on; set it to False",
    "data.no_seqlen_plus_one_input_tokens": "a sample is seq_length + 1 tokens (inputs and shifted labels); set it "
                                            "to False",
    "data.pad_samples_to_global_batch_size": "a last partial batch is dropped, not padded; set it to False",
    "data.validation_drop_last": "validation reads whole global batches; set it to True",
    "data.tokenizer.model": "a SentencePiece .model is not read here; give the Hugging Face tokenizer's directory "
                            "as data.tokenizer.type and set data.tokenizer.model to null",
    "model.rotary_percentage": "rotary embeddings on part of each head are not built; set it to 1.0",
    "model.transformer_block_type": "only pre-norm blocks (pre_ln) are built; set it to pre_ln",
    "model.use_scaled_init_method": "layers writing into the residual stream always get Megatron's scaled init, "
                                    "std / sqrt(2 x num_layers); set it to True",
}

# Values that are the default here and so need no mapping (a key with another value is refused).
NEUTRAL = {"distributed_strategy.token_shuffle_group_size": 1, "model.moe.routing_algorithm": "top_k",
           "model.moe.dropout": 0.0, "model.moe.output_router_logits": True,
           "model_alignment_strategy.peft.lora_bias": "none",
           "model_alignment_strategy.peft.load_lora_from_ckpt": False,
           "data.data_impl": "mmap", "data.dataloader_type": "single", "data.eod_mask_loss": False,
           "data.no_seqlen_plus_one_input_tokens": False,
           "data.pad_samples_to_global_batch_size": False, "data.validation_drop_last": True,
           "data.tokenizer.model": None, "model.rotary_percentage": 1, "model.transformer_block_type": "pre_ln",
           "model.use_scaled_init_method": True}

# A value that means something else here, said with another key: (value, our key, its value, why). Applied after
# the file's own keys, so they cannot undo it.
IMPLIES: dict[str, tuple[Any, str, Any, str]] = {
    "model.moe.output_router_logits": (
        False, "training.model.moe.router_aux_loss_coef", 0.0,
        "NxD Training adds the load-balancing loss only when the router logits are output"),
}

# Mapped keys whose null is a value of its own in NxD Training, not "use the default": carried over as null.
NULL_MEANS = {"model.moe.capacity_factor": "no capacity, every token reaches its top_k experts (NxD's all-experts "
                                           "path)",
              "model.num_kv_heads": "every attention head has its own key and value (multi-head attention)"}

# What NxD Training's Mixtral module (lightning_modules/model/hf_models/mixtral_model.py) assumes for a model.moe key
# the file leaves out; it overrides the model_config's values, so an imported file gets the same here.
NXD_MOE_DEFAULTS = {"top_k": 1, "frequency": 1, "capacity_factor": 1.0, "router_aux_loss_coef": 0.02,
                    "normalize_top_k_affinities": True}

# A megatron file names its architecture with four switches; each architecture lists its combinations of them in
# runtime/schema/families (`megatron`). A switch the file leaves out takes NxD's default (megatron_gpt_model.py).
MEGATRON_SWITCHES = ("model.normalization", "model.position_embedding_type", "model.activation", "model.has_bias")
MEGATRON_SWITCH_DEFAULTS = ("layernorm", "learned_absolute", "gelu", True)
MEGATRON_BASE = ARCHITECTURES[megatron_architecture(MEGATRON_SWITCH_DEFAULTS)]  # a file that names none of them
# NxD's megatron model's values for model keys a file leaves out, where our base recipes' differ (our key: value).
MEGATRON_DEFAULTS = {"share_embeddings_and_output_weights": True, "hidden_dropout": 0.1, "num_query_groups": None}
# NeMo's Megatron tokenizer names GPT-2's BPE so, built from vocab_file + merge_file.
GPT2_BPE = "GPT2BPETokenizer"


@dataclass
class Mapping:
    """What one NxD Training file becomes."""

    source: Path
    training: dict[str, Any]                  # the stage's config (a defaults list + our keys)
    cluster: dict[str, Any]                   # cluster.* overrides (the Neuron compiler keys)
    rows: list[tuple[str, Any, str]] = field(default_factory=list)   # (key in the file, value, what became of it)
    dialect: str = "NxD Training"
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stage: str = "training"                   # the stage it configures: training | fine_tuning | peft | alignment
    stage_reason: str = ""                    # which of its keys says so

    @property
    def name(self) -> str:
        """The Hydra choice it is registered under: stable for a given file content."""
        digest = hashlib.sha256(repr(sorted(_flatten(self.training).items())).encode()).hexdigest()[:10]
        stem = re.sub(r"\W", "_", self.source.stem)  # a plain Hydra choice name, whatever the file is called
        return f"_imported_{stem}_{digest}"


def load(path: str, group: str = "training") -> tuple[dict[str, Any], bool]:
    """The file, and whether it is NeMo-Launcher's. An NxD Training file is resolved on its own (its
    interpolations, e.g. ${trainer.max_steps}, refer to its own keys); a NeMo-Launcher file's refer to the launch
    config (${base_results_dir}, ${training.run.name}) and are left for it to resolve."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import yaml

    text = config_file.read(path, f"{group}=@{path}", f"an NxD Training or NeMo-Launcher {group} YAML")
    register_resolvers()
    try:
        loaded = OmegaConf.load(io.StringIO(text))
        raw = OmegaConf.to_container(loaded, resolve=False)
        if not raw:
            raise UserError(f"{group}=@{path}: the file holds no keys; give an NxD Training or NeMo-Launcher "
                            f"{group} YAML")
        if not isinstance(raw, dict):
            raise UserError(f"{group}=@{path}: holds {type(raw).__name__}, not a {group} config mapping")
        if nemo_config.is_nemo(raw):
            return raw, True
        return OmegaConf.to_container(loaded, resolve=True), False
    except yaml.MarkedYAMLError as error:  # what only composing finds, e.g. an alias to no anchor
        raise UserError(f"{group}=@{config_file.syntax_error(path, error)}") from None
    except (OmegaConfBaseException, ValueError, OSError, yaml.YAMLError) as error:
        raise UserError(f"{group}=@{path}: cannot be read as YAML ({str(error).splitlines()[0]})") from None


def nxd_stage(data: dict[str, Any]) -> tuple[str, str]:
    """The stage an NxD Training file configures, and the key that says so."""
    alignment = data.get("model_alignment_strategy") if isinstance(data.get("model_alignment_strategy"), dict) else {}
    if strategies := alignment_strategies(data):
        section, strategy = strategies[0]
        return "alignment", f"{section}.{strategy}"
    if alignment.get("peft"):
        return "peft", "model_alignment_strategy.peft (LoRA)"
    if "sft" in alignment:
        return "fine_tuning", "model_alignment_strategy.sft"
    if ((data.get("model") or {}) if isinstance(data.get("model"), dict) else {}).get("weight_init_only"):
        return "fine_tuning", "model.weight_init_only"
    return "training", ""


def alignment_strategies(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(section, strategy) for each DPO / ORPO subsection an NxD Training file holds: under model_alignment_strategy,
    or data.alignment_strategy in NxD's older DPO files."""
    found = []
    for section in ("model_alignment_strategy", "data.alignment_strategy"):
        node: Any = data
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        found += [(section, s) for s in ALIGNMENT_KEYS if isinstance(node, dict) and s in node]
    return found


def map_file(path: str, group: str | None = None) -> Mapping:
    """`group`: the stage it was given as (<group>=@FILE), which names it in errors; None: the stage it configures."""
    data, nemo = load(path, group or "training")
    if nemo:
        return _map_nemo(path, data, group)
    stage, reason = nxd_stage(data)
    at = f"{group or stage}=@{path}"
    flat = _flatten(data, {**IGNORED, **UNSUPPORTED})
    result = Mapping(Path(path), {}, {}, stage=stage, stage_reason=reason)
    training: dict[str, Any] = {}
    weights = stage != "training" and bool((data.get("model") or {}).get("weight_init_only"))
    tokenizer, rows, warnings, errors = _map_tokenizer(flat, at)
    if tokenizer:
        training.setdefault("model", {})["tokenizer"] = tokenizer
    result.rows += rows
    result.warnings += warnings
    result.errors += errors
    for key, value in flat.items():
        top = longest_prefix(key, UNSUPPORTED)
        if key in TOKENIZER_KEYS:
            continue  # _map_tokenizer's
        elif top is not None and NEUTRAL.get(key, object()) != value:
            result.errors.append(f"{at}: {key} is not supported: {UNSUPPORTED[top]}")
            result.rows.append((key, value, "refused: " + UNSUPPORTED[top]))
        elif key == SEQUENTIAL_MOVE_FACTOR and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            result.errors.append(f"{at}: {key}: {value!r} must be a positive integer (the ranks NxD Training moves "
                                 f"to the device at a time), e.g. {key}: 11; or leave it out, it changes nothing "
                                 f"here")
            result.rows.append((key, value, "refused: not a positive integer"))
        elif stage != "training" and (key in FINE_TUNING_MAPPED or (weights and key == WEIGHTS_FROM)):
            target = FINE_TUNING_MAPPED.get(key, "training.model.restore_from_path")
            converted = value if key == WEIGHTS_FROM or value is None or isinstance(value, list) else [value]
            if key == "data.val_dir" and value is None:
                converted = []  # NxD's val_dir: null is no validation files
            _put(training, target[len("training."):], converted)
            result.rows.append((key, value, target if converted == value else f"{target} = {converted!r}"))
        elif key == "model.encoder_seq_length" and flat.get("data.seq_length") not in (None, value):
            # NxD's SFT files train on data.seq_length and keep the model's own length for its positions.
            result.rows.append((key, value, f"ignored: sequences are data.seq_length ({flat['data.seq_length']}) "
                                            f"long; positions come from max_position_embeddings (config.json's, with "
                                            f"model_config)"))
        elif key == "model.max_position_embeddings" and flat.get("model.model_config") is not None:
            # NxD Training's files set it for their RoPE table (Mixtral's to encoder_seq_length, under config.json's
            # 32768); here config.json decides every key, and a table of either length computes the same rows.
            result.rows.append((key, value, "ignored: model_config's config.json decides max_position_embeddings "
                                            "(the RoPE table's length; every row of encoder_seq_length computes the "
                                            "same)"))
        elif key in MEGATRON_SWITCHES:
            result.rows.append((key, value, "with the other switches: training.model.architecture"))
        elif key == "model.sliding_window_size":
            if (problem := _sliding_window(value, flat)) is not None:
                result.errors.append(f"{at}: {key}: {problem}")
            result.rows.append((key, value, f"refused: {problem}" if problem else
                                "the default here: no sequence is longer than the window"))
        elif key == "compiler_cache_url" and _is_relative(value):
            # NxD resolves it in the job's working directory; the shared results root is the one every node sees.
            relative = value.removeprefix("./")
            _put(result.cluster, "neuron.compile.cache", f"${{base_results_dir}}/{relative}")
            result.rows.append((key, value, f"cluster.neuron.compile.cache = '<base_results_dir>/{relative}'"))
            result.warnings.append(
                f"{at}: {key}: {value!r} is relative; NxD Training resolves it in the job's working directory, and "
                f"the cache must be a directory every node sees: it becomes <base_results_dir>/{relative} "
                f"(cluster.neuron.compile.cache), which the nodes share and later runs reuse; set "
                f"cluster.neuron.compile.cache to place it elsewhere")
        elif key == "model.activations_checkpoint_recompute" and isinstance(value, list) and \
                any(m in RECOMPUTE_NEAREST for m in value):
            modules = list(dict.fromkeys(RECOMPUTE_NEAREST.get(m, (m,))[0] for m in value if
                                         RECOMPUTE_NEAREST.get(m, (m,))[0] is not None))
            _put(training, "model.activations_checkpoint_recompute", modules)
            result.rows.append((key, value, f"training.model.activations_checkpoint_recompute = {modules!r}"))
            for module in (m for m in value if m in RECOMPUTE_NEAREST):
                result.warnings.append(f"{at}: {key}: {module}: {RECOMPUTE_NEAREST[module][1]}")
        elif key == "model.weight_init_only":
            result.rows.append((key, value, f"with {WEIGHTS_FROM}: training.model.restore_from_path" if value
                                else "the default here"))
        elif key in NULL_MEANS and value is None:
            _put(training, MAPPED[key][len("training."):], None)
            result.rows.append((key, value, f"{MAPPED[key]} = None: {NULL_MEANS[key]}"))
        elif key in MAPPED and value is None:
            result.rows.append((key, value, "null: the base recipe's value stays"))
        elif key in FRACTIONS and isinstance(value, float) and value != 0:
            result.errors.append(f"{at}: {key}: {value!r} is a fraction of an epoch (PyTorch Lightning's "
                                 f"float form); nxdt-launch counts steps: give a whole number")
            result.rows.append((key, value, "refused: a fraction of an epoch"))
        elif key in OVER_CONFIG_JSON and flat.get("model.model_config") is not None:
            if value == -1:  # NxD's "not set"
                result.rows.append((key, value, "-1: config.json's value stays"))
            else:
                target = f"training.model.model_config_overrides.{OVER_CONFIG_JSON[key]}"
                _put(training, target[len("training."):], value)
                result.rows.append((key, value, f"{target}: applied over config.json, as NxD Training does"))
        elif key in MAPPED:
            target = MAPPED[key]
            if target.startswith("cluster."):
                _put(result.cluster, target[len("cluster."):], value)
            else:
                _put(training, target[len("training."):], value)
            result.rows.append((key, value, target))
        elif key in IMPLIES and value == IMPLIES[key][0]:
            _, target, implied, why = IMPLIES[key]
            result.rows.append((key, value, f"{target} = {implied!r}: {why}"))
        elif key in NEUTRAL:
            result.rows.append((key, value, "the default here"))
        elif (ignored := longest_prefix(key, IGNORED)) is not None:
            result.rows.append((key, value, "ignored: " + IGNORED[ignored]))
        elif key in DIFFERS:
            expected, why = DIFFERS[key]
            result.rows.append((key, value, "the default here" if value != expected else f"differs: {why}"))
            if value == expected:
                result.warnings.append(f"{at}: {key}: {value!r} is ignored: {why}")
        else:
            result.rows.append((key, value, "unknown"))
            result.errors.append(f"{at}: {key} is not an NxD Training key nxdt-launch knows; remove it "
                                 f"(`nxdt-launch explain-config {path}` lists every key and what it maps to)")
    if (renamed := _dpo_renamed(flat)) is not None:
        result.errors.append(f"{at}: {renamed}")
    megatron = data.get("model_source") == "megatron"
    if megatron or any(key in flat for key in MEGATRON_SWITCHES):
        architecture, row = _architecture(flat)
        if architecture is None:
            result.errors.append(f"{at}: {row[2]}")
        else:
            _put(training, "model.architecture", architecture)
        result.rows.append(row)
    if megatron:
        result.rows += _megatron_defaults(flat, training)
    if result.errors:
        return result
    for key, (trigger, target, implied, _) in IMPLIES.items():
        if flat.get(key, object()) == trigger:
            _put(training, target[len("training."):], implied)
    result.rows += _nxd_moe_defaults(training)
    if stage == "training" and data.get("model_source") == "hf" and (data.get("data") or {}).get("train_dir"):
        result.warnings.append(
            f"{at}: data.train_dir: NxD Training's hf configs point it at a Hugging Face datasets "
            f"directory; nxdt-launch trains on Megatron indexed data: prepare it with stages=[data_preparation] and "
            f"point training.model.data.data_prefix at the result")
    if weights and flat.get(WEIGHTS_FROM) is None:
        result.errors.append(f"{at}: model.weight_init_only: True without {WEIGHTS_FROM}: there are no weights to "
                             f"start from; set {WEIGHTS_FROM} to a Hugging Face model directory")
    elif weights:
        result.warnings.append(f"{at}: {WEIGHTS_FROM}: {flat[WEIGHTS_FROM]} becomes {stage}.model.restore_from_path, "
                               f"which reads a Hugging Face model directory or an nxdt-launch checkpoint, not NxD "
                               f"Training's own checkpoint format: point it at the Hugging Face model NxD's "
                               f"checkpoint was converted from")
    if stage == "peft" or (stage == "alignment" and isinstance(data.get("model_alignment_strategy"), dict)
                           and data["model_alignment_strategy"].get("peft")):  # DPO / ORPO with LoRA
        _put(training, "model.peft.peft_scheme", "lora")
        result.rows.append(("(implied) model_alignment_strategy.peft", "lora",
                            "training.model.peft.peft_scheme = 'lora'"))
    if stage == "alignment":
        strategies = sorted({strategy for _, strategy in alignment_strategies(data)})
        if len(strategies) > 1:
            result.errors.append(f"{at}: model_alignment_strategy: both {' and '.join(strategies)} are set; an "
                                 f"alignment run has one strategy: keep one section")
            return result
        training["strategy"] = strategies[0]
        result.rows.append((f"(implied) {reason}", strategies[0], f"training.strategy = {strategies[0]!r}"))
    result.training = _with_base(training, data, stage)
    result.rows += _from_base(result.training, stage)
    result.rows = _under_stage(result.rows, stage)
    ignored = [key for key, _, what in result.rows if what.startswith("ignored: ")]
    if ignored:
        result.warnings.append(f"{at}: {len(ignored)} keys ignored, whose effect nxdt-launch has already "
                               f"or that tune NxD's own implementation ({', '.join(ignored[:3])}, ...); "
                               f"`nxdt-launch explain-config {path}` lists each with the reason")
    return result


TOKENIZER_KEYS = ("data.tokenizer.library", "data.tokenizer.type", "data.tokenizer.vocab_file",
                  "data.tokenizer.merge_file")


def _map_tokenizer(flat: dict[str, Any], at: str) -> tuple[dict[str, Any], list, list[str], list[str]]:
    """NxD's data.tokenizer -> our model.tokenizer (one Hugging Face tokenizer.json): (our keys, rows, warnings,
    errors). type names the tokenizer's directory, for NeMo's huggingface library and its megatron library alike
    (which loads a name it does not know as a Hugging Face tokenizer); the megatron library's GPT2BPETokenizer is
    GPT-2's BPE from vocab_file + merge_file, which one tokenizer.json holds too."""
    ours: dict[str, Any] = {}
    rows, warnings, errors = [], [], []
    library, kind = flat.get("data.tokenizer.library"), flat.get("data.tokenizer.type")
    if library in ("huggingface", "megatron"):
        ours["library"] = "huggingface"
        rows.append(("data.tokenizer.library", library, "training.model.tokenizer.library = 'huggingface'"
                     + ("" if library == "huggingface" else ": the tokenizer data.tokenizer.type names, as a "
                                                           "tokenizer.json")))
    elif "data.tokenizer.library" in flat:
        errors.append(f"{at}: data.tokenizer.library: {library!r} is not read here; nxdt-launch reads a Hugging Face "
                      f"tokenizer.json: set it to huggingface and data.tokenizer.type to the tokenizer's directory")
    pair = {key: flat.get(f"data.tokenizer.{key}") for key in ("vocab_file", "merge_file")}
    if kind == GPT2_BPE:
        if None in pair.values():
            errors.append(f"{at}: data.tokenizer.type: {GPT2_BPE} is GPT-2's BPE, built from data.tokenizer.vocab_file "
                          f"and merge_file; set both (GPT-2's vocab.json and merges.txt)")
            return ours, rows, warnings, errors
        ours["model"] = str(Path(str(pair["vocab_file"])).parent / "tokenizer.json")
        rows.append(("data.tokenizer.type", kind, f"with vocab_file and merge_file: training.model.tokenizer.model = "
                                                  f"{ours['model']!r}"))
        rows += [(f"data.tokenizer.{key}", value, "with type: training.model.tokenizer.model")
                 for key, value in pair.items()]
        warnings.append(f"{at}: data.tokenizer: GPT-2's BPE ({pair['vocab_file']} + {pair['merge_file']}) is read "
                        f"here as one tokenizer.json, training.model.tokenizer.model = {ours['model']} (beside "
                        f"vocab_file): write it there (a data_preparation stage with tokenizer.vocab_file and "
                        f"merge_file writes one) or point training.model.tokenizer.model at one")
        return ours, rows, warnings, errors
    if kind is not None:
        ours["model"] = _tokenizer_json(kind)
        rows.append(("data.tokenizer.type", kind, f"training.model.tokenizer.model = {ours['model']!r}"))
    elif "data.tokenizer.type" in flat:
        rows.append(("data.tokenizer.type", kind, "null: the base recipe's value stays"))
    for key, value in pair.items():
        if value is not None:
            errors.append(f"{at}: data.tokenizer.{key} is read only with data.tokenizer.type: {GPT2_BPE} (GPT-2's "
                          f"BPE); set it to null, or type to {GPT2_BPE}")
        elif f"data.tokenizer.{key}" in flat:
            rows.append((f"data.tokenizer.{key}", value, "the default here"))
    return ours, rows, warnings, errors


def _tokenizer_json(kind: Any) -> str:
    """NxD names the tokenizer's directory; we read its tokenizer.json."""
    path = Path(str(kind))
    return str(path if path.suffix == ".json" else path / "tokenizer.json")


def _architecture(flat: dict[str, Any]) -> tuple[str | None, tuple[str, str, str]]:
    """A megatron file's four switches -> (our model.architecture or None, the row that says why)."""
    values = tuple(flat.get(key, default) for key, default in zip(MEGATRON_SWITCHES, MEGATRON_SWITCH_DEFAULTS))
    architecture = megatron_architecture(values)
    key = f"model.{{{', '.join(key.removeprefix('model.') for key in MEGATRON_SWITCHES)}}}"
    shown = ", ".join(map(str, values))
    if architecture is None:
        return None, (key, shown, f"{key}: {shown} is no architecture built here: {megatron_choices()}; set "
                                  f"the four to one of them")
    return architecture, (f"(implied) {key}", shown, f"training.model.architecture = {architecture!r}")


def _megatron_defaults(flat: dict[str, Any], training: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """NxD's megatron model's values for the keys a file leaves out, and its vocabulary padding (a multiple of
    make_vocab_size_divisible_by x tensor_model_parallel_size, as its data module pads), put into `training`."""
    model = training.setdefault("model", {})
    rows = []
    for key, value in MEGATRON_DEFAULTS.items():
        if key not in model:
            model[key] = value
            rows.append((f"(not in the file) {key}", value, f"training.model.{key} = {value!r}, NxD Training's "
                                                            f"megatron default"))
    divisor, tp = model.get("make_vocab_size_divisible_by") or 128, model.get("tensor_model_parallel_size") or 1
    model["make_vocab_size_divisible_by"] = divisor * tp
    rows.append(("(implied) model.make_vocab_size_divisible_by x tensor_model_parallel_size", f"{divisor} x {tp}",
                 f"training.model.make_vocab_size_divisible_by = {divisor * tp}: NxD Training's megatron data "
                 f"module pads the vocabulary to a multiple of both"))
    return rows


def _sliding_window(window: Any, flat: dict[str, Any]) -> str | None:
    """NxD masks keys more than `window` positions back: nothing, when no sequence is longer than the window."""
    seq = flat.get("data.seq_length") or flat.get("model.encoder_seq_length")
    if window is None or (isinstance(seq, int) and isinstance(window, int) and window >= seq):
        return None
    return (f"{window!r}: a megatron model here attends to the whole sequence (sliding windows are built only in the "
            f"families whose config.json has them); a window below the sequence length ({seq}) changes the "
            f"attention: set it to null")


def _is_relative(path: Any) -> bool:
    """A local path NxD resolves in the job's working directory (not absolute, no URL, no ~ or $ to expand)."""
    return isinstance(path, str) and bool(path) and not path.startswith(("/", "~", "$")) and "://" not in path


def _dpo_renamed(flat: dict[str, Any]) -> str | None:
    """DPO's prompt limit under both its names, with two values: which one is meant is the user's to say."""
    for section in ("model_alignment_strategy", "data.alignment_strategy"):
        new, old = (flat.get(f"{section}.dpo.{name}") for name in DPO_RENAMED)
        if new is not None and old is not None and new != old:
            return (f"{section}.dpo: max_prompt_length ({new}) and its older name max_dpo_prompt_length ({old}) "
                    f"disagree; keep one")
    return None


def _under_stage(rows: list[tuple[str, Any, str]], stage: str) -> list[tuple[str, Any, str]]:
    """Rows name our keys under `training.`; a fine-tuning file's are its stage's."""
    if stage == "training":
        return rows
    return [(key, value, re.sub(r"(^|with \S+: )training\.", rf"\g<1>{stage}.", what)) for key, value, what in rows]


def _with_base(training: dict[str, Any], data: dict[str, Any], stage: str = "training") -> dict[str, Any]:
    """On top of the family's smallest recipe (run keys, checkpoint defaults, data splits): the file's keys, and
    nulls for every shape key that config.json (model.model_config) supplies, so nothing of the base's shape
    leaks into the imported model. A fine-tuning file sits on <stage>/llama/tiny, without its demo data."""
    model = training.setdefault("model", {})
    architecture = model.get("architecture")  # a megatron file's; an hf file's comes from its model_config
    if architecture is None and "model_config" not in model:  # a megatron file named for its network
        architecture = next((name for name in ARCHITECTURES if name in str(data.get("name", ""))), None)
    family = ARCHITECTURES.get(architecture, HF_BASE).tiny_recipe
    if stage != "training":
        # An alignment file sits on the tiny recipe of its strategy: the other's section would be a second strategy.
        family = f"llama/tiny_{training['strategy']}" if stage == "alignment" else "llama/tiny"
        model.setdefault("restore_from_path", None)
        sft = model.setdefault("data", {})
        sft.setdefault("train_ds", {}).setdefault("file_names", [])
        sft.setdefault("validation_ds", {}).setdefault("file_names", [])
    training.setdefault("trainer", {})["accelerator"] = "neuron"  # NxD Training runs on Trainium
    if "model_config" in model:
        for key in ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "add_qkv_bias", "qk_layernorm", "rope_scaling", "rotary_base",
                    "layernorm_epsilon", "share_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                    "max_position_embeddings"):
            model.setdefault(key, None)
        tokenizer = model.setdefault("tokenizer", {})
        tokenizer.setdefault("model", None)
    seq = model.get("encoder_seq_length") or (model.get("data") or {}).get("seq_length")
    if seq is not None:
        model.setdefault("encoder_seq_length", seq)
        model.setdefault("data", {}).setdefault("seq_length", seq)
    model.setdefault("data", {}).setdefault("data_prefix", None)
    # NxD Training's own defaults where the base recipe's would differ: decay to 0, no time limit of its own.
    sched = model.setdefault("optim", {}).setdefault("sched", {})
    sched.setdefault("min_lr", 0.0)
    sched.setdefault("constant_steps", 0)
    training.setdefault("run", {}).setdefault("time_limit", "UNLIMITED")
    if model.get("virtual_pipeline_model_parallel_size") == 1:
        model["virtual_pipeline_model_parallel_size"] = None  # NxD writes 1 for "no interleaving"
    return {"defaults": [f"/{stage}/{family}@_here_", "_self_"], **training}


def _nxd_moe_defaults(training: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """NxD Training's values for the model.moe keys a file with model.moe leaves out (ours differ: top_k 2,
    dropless, no auxiliary loss), put into `training`; rows for explain-config."""
    moe = (training.get("model") or {}).get("moe")
    if not isinstance(moe, dict):
        return []
    rows = []
    for key, value in NXD_MOE_DEFAULTS.items():
        if key not in moe:
            moe[key] = value
            rows.append((f"(not in the file) model.moe.{key}", value,
                         f"training.model.moe.{key} = {value!r}, NxD Training's default"))
    return rows


def _from_base(training: dict[str, Any], stage: str = "training") -> list[tuple[str, Any, str]]:
    """Rows for the keys the file leaves to the base recipe, so explain-config shows every value that will run."""
    from omegaconf import OmegaConf

    from launcher.paths import conf_dir

    recipe = training["defaults"][0].removeprefix("/").removesuffix("@_here_")  # e.g. training/llama/tiny
    chain, seen = [recipe], {}
    while chain:  # the recipe's own defaults first, then the recipe over them
        name = chain.pop()
        data = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{name}.yaml"), resolve=False)
        parents = [d.removeprefix("/").removesuffix("@_here_") for d in data.get("defaults", [])
                   if isinstance(d, str) and d.startswith("/") and d.endswith("@_here_")]
        seen = {**_flatten({k: v for k, v in data.items() if k != "defaults"}), **seen}
        chain += parents
    given = _flatten({k: v for k, v in training.items() if k != "defaults"})
    return [(f"(not in the file) {key}", value, f"{stage}.{key}, from the base recipe {recipe}")
            for key, value in sorted(seen.items()) if key not in given]


def _flatten(data: Any, stops: dict | set = frozenset(), prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> leaf values; a key in `stops` is a leaf whatever it holds."""
    if isinstance(data, dict) and data and not (prefix and prefix in stops):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, stops, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


def _our_keys() -> set[str]:
    """Every training key our reference recipes set, plus the schema's optional ones (Megatron's names, as NeMo's:
    kv_channels is the head size, null for hidden_size / num_attention_heads; ffn_dropout the MLP's dropout; SGD's
    momentum, dampening and nesterov, torch.optim.SGD's names as NeMo's optim section passes them on)."""
    from omegaconf import OmegaConf

    from launcher.paths import conf_dir

    keys = {"model.num_query_groups", "model.rotary_base", "model.model_config", "model.kv_channels",
            "model.add_qkv_bias", "model.qk_layernorm", "model.pipeline_cuts", "model.data.reset_position_ids",
            "model.data.reset_attention_mask", "model.ffn_dropout", "model.optim.momentum", "model.optim.dampening",
            "model.optim.nesterov"}
    for recipe in ("training/gpt3/tiny", "training/llama/tiny", "fine_tuning/llama/tiny", "peft/llama/tiny"):
        data = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{recipe}.yaml"), resolve=False)
        keys |= set(_flatten({k: v for k, v in data.items() if k != "defaults"}))
    return keys - {"run.results_dir"}  # nemo_config.IGNORED says why


def _map_nemo(path: str, data: dict[str, Any], group: str | None = None) -> Mapping:
    stage, reason = nemo_config.nemo_stage(data)
    at = f"{group or stage}=@{path}"
    result = Mapping(Path(path), {}, {}, dialect="NeMo-Launcher", stage=stage, stage_reason=reason)
    training: dict[str, Any] = {}
    ignored: list[str] = []

    def error(key: str, why: str) -> None:
        result.errors.append(f"{at}: {key} {why}")
        result.rows.append((key, flat[key], "refused: " + why))

    flat = _flatten(data, set(nemo_config.IGNORED))
    nemo_config.map_keys(
        flat, _our_keys(), put=lambda key, value: _put(training, key, value),
        row=lambda key, value, what: result.rows.append((key, value, what)), error=error,
        warn_key=ignored.append)
    if result.errors:
        return result
    # NeMo's checkpoint callback saves at every validation: every val_check_interval steps.
    every = "exp_manager.checkpoint_callback_params.every_n_train_steps"
    if every not in flat and isinstance(flat.get("trainer.val_check_interval"), int):
        _put(training, every, flat["trainer.val_check_interval"])
        result.rows.append((every, None, f"training.{every} = trainer.val_check_interval (NeMo saves at validation)"))
    family = ARCHITECTURES.get(training.get("model", {}).get("architecture"), MEGATRON_BASE).tiny_recipe
    if stage != "training":  # the fine-tuning base, without its demo data and weights
        family, model = "llama/tiny", training.setdefault("model", {})
        model.setdefault("restore_from_path", None)
        for split in ("train_ds", "validation_ds"):
            model.setdefault("data", {}).setdefault(split, {}).setdefault("file_names", [])
    result.training = {"defaults": [f"/{stage}/{family}@_here_", "_self_"], **training}
    result.rows = _under_stage(result.rows, stage)
    if ignored:
        result.warnings.append(f"{at}: {len(ignored)} NeMo keys ignored, whose effect nxdt-launch has "
                               f"already or that only tune NeMo's own implementation ({', '.join(ignored[:3])}, "
                               f"...); `nxdt-launch explain-config {path}` lists each with the reason")
    return result


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def cluster_overrides(mapping: Mapping) -> list[str]:
    """cluster.neuron.* as Hydra overrides (`++`: the key may be new on a non-Neuron cluster group)."""
    if not mapping.cluster:
        return []
    return [f"++cluster.{key}={_hydra_value(value)}" for key, value in _flatten(mapping.cluster).items()]


def _hydra_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if not isinstance(value, str):
        return str(value)
    if "'" not in value:
        return f"'{value}'"  # inside quotes only a quote (and the backslashes before one) needs escaping
    if '"' not in value:
        return f'"{value}"'
    return "'" + value.replace("'", "\\'") + "'"


# The groups a file may be given to: the stages whose config is a training config.
FILE_GROUPS = ("training", "fine_tuning", "peft", "alignment")


def expand(overrides: list[str]) -> tuple[list[str], list[str]]:
    """`training=@FILE` (`fine_tuning=@FILE`, `peft=@FILE`, `alignment=@FILE`) -> `<group>=<registered name>` plus
    the file's cluster overrides, placed where it stood so that later overrides win. A fine-tuning or alignment file
    also names the run, as a training file does through training.run.name, unless run_name is given. Returns
    (overrides, warnings); a file with refused keys, or given as another stage than the one it configures, is a
    UserError."""
    out, warnings = [], []
    named = any(o.partition("=")[0].lstrip("+") == "run_name" for o in overrides)
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+")
        if group not in FILE_GROUPS or not sep or not is_file_choice(value):
            out.append(override)
            continue
        mapping = map_file(value[1:], group)
        if mapping.stage != group:  # first: the file's other mistakes are named by the right stage then
            verb = "aligns" if mapping.stage == "alignment" else "fine-tunes"
            what = f"it {verb} ({mapping.stage_reason})" if mapping.stage_reason else "it pretrains"
            raise UserError(f"{group}=@{value[1:]}: {what}, so it runs as the {mapping.stage} stage: launch it with "
                            f"stages=[{mapping.stage}] {mapping.stage}=@{value[1:]}")
        if mapping.errors:
            raise UserError(*mapping.errors)
        store_choice(group, mapping.name, mapping.training)
        out += [f"{group}={mapping.name}", *cluster_overrides(mapping)]
        if group != "training" and not named:
            out.append(f"run_name=${{{group}.run.name}}")
        warnings += mapping.warnings
    return out, warnings
