"""NxD Training's keys, dotted, and what each becomes here: the tables launcher/nxdt_config.py's map_file reads
(mapped, ignored with the reason, refused with where it is heading, and the values that mean something of their
own), and the two helpers between a nested file and its dotted keys (flatten, put).
"""

from __future__ import annotations

from typing import Any

from runtime.schema.families import ARCHITECTURES, megatron_architecture

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

# data.tokenizer's keys that _map_tokenizer (launcher/nxdt_mapping.py) reads together, before the other keys.
TOKENIZER_KEYS = ("data.tokenizer.library", "data.tokenizer.type", "data.tokenizer.vocab_file",
                  "data.tokenizer.merge_file")


def flatten(data: Any, stops: dict | set = frozenset(), prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> leaf values; a key in `stops` is a leaf whatever it holds."""
    if isinstance(data, dict) and data and not (prefix and prefix in stops):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(flatten(value, stops, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


def put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """`value` at the dotted key of a nested `tree`, making the parents it lacks."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
