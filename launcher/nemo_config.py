"""NeMo-Launcher training YAML files (e.g. its conf/training/gpt3/5b.yaml) as they are, through the same
`training=@FILE` as NxD Training's (launcher/nxdt_config.py decides which kind a file is).

A NeMo-Launcher file already speaks our keys: those pass through unchanged, with their `${base_results_dir}`,
`${data_dir}` and `${training...}` interpolations resolved in the launch config, as NeMo-Launcher resolves them.
NeMo-only keys are ignored (with the reason) when their value changes nothing here, and refused when it would.
NeMo-Launcher's fine_tuning and peft files (model.restore_from_path, model.data.train_ds / validation_ds,
model.peft) speak our keys too, apart from LoRA's sizes under model.peft.lora_tuning, which are mapped.
"""

from __future__ import annotations

from typing import Any

# NeMo keys that nxdt-launch has no use for, or whose effect it always has. value None: any value is fine;
# otherwise the values that change nothing here (another value is refused: it would change the training).
IGNORED: dict[str, tuple[tuple | None, str]] = {
    "hydra": (None, "NeMo's own config search path"),
    "run.results_dir": (None, "each stage writes under <base_results_dir>/<run_name>/<stage>"),
    "trainer.logger": (None, "loggers come from exp_manager"),
    "trainer.enable_checkpointing": (None, "checkpoints come from exp_manager"),
    "trainer.use_distributed_sampler": (None, "data-parallel batches come from the runtime's own sampler"),
    "trainer.max_epochs": (None, "training is step based (trainer.max_steps)"),
    "trainer.max_time": (None, "the job's run.time_limit bounds it; preemption saves before it"),
    "trainer.limit_test_batches": (None, "the test split is scored by the evaluation stage"),
    "trainer.accumulate_grad_batches": ((1,), "gradient accumulation follows from the batch sizes"),
    "exp_manager.explicit_log_dir": (None, "logs go to the training stage's results directory"),
    "exp_manager.exp_dir": (None, "logs go to the training stage's results directory"),
    "exp_manager.name": (None, "the run is named by run.name"),
    "exp_manager.wandb_logger_kwargs": (None, "the W&B run is named after the run"),
    "exp_manager.resume_ignore_no_checkpoint": (None, "resume_if_exists starts fresh when there is no checkpoint"),
    "exp_manager.checkpoint_callback_params.monitor": (None, "checkpoints are kept newest-first (save_top_k)"),
    "exp_manager.checkpoint_callback_params.mode": (None, "checkpoints are kept newest-first (save_top_k)"),
    "exp_manager.checkpoint_callback_params.always_save_nemo": ((False,), "no .nemo files; conversion exports"),
    "exp_manager.checkpoint_callback_params.save_nemo_on_train_end": ((False,), "no .nemo files; conversion exports"),
    "exp_manager.checkpoint_callback_params.filename": (None, "checkpoint directories are named step_<N>.<launch>"),
    "exp_manager.checkpoint_callback_params.model_parallel_size": (None, "derived from the layout"),
    "exp_manager.log_step_timing": (None, "step time is logged at every logged step"),
    "exp_manager.step_timing_kwargs": (None, "step time is logged at every logged step"),
    "model.rampup_batch_size": ((None,), "no batch-size ramp-up"),
    "model.apply_query_key_layer_scaling": (None, "a no-op in bf16 and fp32 (it guards fp16 overflow)"),
    "model.pre_process": ((True,), "every model has its embedding"),
    "model.post_process": ((True,), "every model has its output layer"),
    "model.persist_layer_norm": (None, "kernel choice"),
    "model.gradient_as_bucket_view": (None, "gradients live in flat buckets already"),
    "model.grad_div_ar_fusion": (None, "kernel choice"),
    "model.gradient_accumulation_fusion": (None, "kernel choice"),
    "model.bias_activation_fusion": (None, "kernel choice"),
    "model.bias_dropout_add_fusion": (None, "kernel choice"),
    "model.masked_softmax_fusion": (None, "kernel choice"),
    "model.activations_checkpoint_method": (None, "full recompute covers every layer"),
    "model.activations_checkpoint_num_layers": (None, "full recompute covers every layer"),
    "model.num_micro_batches_with_partial_activation_checkpoints": ((None,), "not supported; null only"),
    "model.activations_checkpoint_layers_per_pipeline": ((None,), "not supported; null only"),
    "model.fsdp": ((False,), "FSDP is not built; ZeRO-1 is model.zero1"),
    "model.fsdp_sharding_strategy": (None, "FSDP is not built"),
    "model.fsdp_grad_reduce_dtype": (None, "FSDP is not built"),
    "model.fsdp_sharded_checkpoint": (None, "FSDP is not built"),
    "model.overlap_p2p_comm": (None, "the pipeline schedule's own choice"),
    "model.batch_p2p_comm": (None, "the pipeline schedule's own choice"),
    "model.tokenizer.type": (None, "nxdt-launch reads a Hugging Face tokenizer.json (tokenizer.model)"),
    "model.tokenizer.delimiter": (None, "nxdt-launch reads a Hugging Face tokenizer.json (tokenizer.model)"),
    "model.tokenizer.vocab_file": (None, "nxdt-launch reads a Hugging Face tokenizer.json (tokenizer.model); "
                                         "stages=[data_preparation] writes one from vocab_file and merge_file"),
    "model.tokenizer.merge_file": (None, "nxdt-launch reads a Hugging Face tokenizer.json (tokenizer.model)"),
    "model.native_amp_init_scale": (None, "fp16 loss scaling; bf16 needs none"),
    "model.native_amp_growth_interval": (None, "fp16 loss scaling; bf16 needs none"),
    "model.hysteresis": (None, "fp16 loss scaling; bf16 needs none"),
    "model.fp32_residual_connection": ((False,), "residuals keep the parameter dtype"),
    "model.fp16_lm_cross_entropy": ((False,), "the loss is computed in fp32"),
    "model.megatron_amp_O2": (None, "with trainer.precision it selects precision.type"),
    "model.grad_allreduce_chunk_size_mb": (None, "collectives are bucketed by the runtime"),
    "model.sharp": ((False,), "an NCCL network option"),
    "model.mcore_gpt": (None, "one model implementation here"),
    "model.transformer_engine": ((False,), "Transformer Engine is not used"),
    "model.fp8": ((False,), "fp8 is not supported"),
    "model.fp8_e4m3": (None, "fp8 is off"),
    "model.fp8_hybrid": (None, "fp8 is off"),
    "model.fp8_margin": (None, "fp8 is off"),
    "model.fp8_interval": (None, "fp8 is off"),
    "model.fp8_amax_history_len": (None, "fp8 is off"),
    "model.fp8_amax_compute_algo": (None, "fp8 is off"),
    "model.fp8_wgrad": (None, "fp8 is off"),
    "model.ub_tp_comm_overlap": ((False,), "userbuffer overlap is not built"),
    "model.sync_batch_comm": (None, "the pipeline schedule's own choice"),
    "model.use_cpu_initialization": (None, "weights are initialized on the host, then sharded"),
    "model.onnx_safe": (None, "no ONNX export"),
    "model.apex_transformer_log_level": (None, "no apex"),
    "model.nsys_profile": (None, "no Nsight profiling hooks"),
    "model.optim.bucket_cap_mb": (None, "gradient buckets are sized by the runtime"),
    "model.optim.contiguous_grad_buffer": (None, "gradients live in flat buckets already"),
    "model.data.data_impl": (("mmap",), "Megatron's mmap indexed format is the one read"),
    "model.data.skip_warmup": (None, "no page-cache warmup"),
    "model.data.dataloader_type": (("single",), "one pass over the sample index"),
    "model.data.reset_position_ids": ((False,), "documents are not separated inside a sequence"),
    "model.data.reset_attention_mask": ((False,), "documents are not separated inside a sequence"),
    "model.data.eod_mask_loss": ((False,), "the end-of-document token is trained on"),
    # Fine-tuning (NeMo-Launcher's fine_tuning and peft stages).
    "model.answer_only_loss": ((True,), "the loss covers the assistant's answers only"),
    "model.save_nemo_on_validation_end": (None, "no .nemo files; the conversion stage exports"),
    "model.peft.restore_from_path": ((None,), "starting from saved adapters is not built (a peft run resumes its "
                                              "own)"),
    "model.peft.lora_tuning.column_init_method": (None, "A starts random and B at zero: training starts from the "
                                                        "restored model"),
    "model.peft.lora_tuning.row_init_method": (("zero",), "B starts at zero"),
    "model.peft.lora_tuning.layer_selection": ((None,), "adapters go on every layer"),
    "model.peft.lora_tuning.weight_tying": ((False,), "each layer has adapters of its own"),
    "model.peft.lora_tuning.position_embedding_strategy": ((None,), "used with weight_tying only"),
}

# NeMo's LoRA sizes -> ours (NeMo's target_modules names, attention_qkv and the like, are accepted as they are).
LORA_MAPPED = {"model.peft.lora_tuning.adapter_dim": "model.peft.lora_rank",
               "model.peft.lora_tuning.alpha": "model.peft.lora_alpha",
               "model.peft.lora_tuning.adapter_dropout": "model.peft.lora_dropout",
               "model.peft.lora_tuning.target_modules": "model.peft.target_modules"}
# The distributed optimizer's overlap switches -> Megatron-core's names, which the runtime reads. Only a false is
# carried over: overlap is on by default in the runtime as in NeMo, so a true changes nothing and the translated
# file stays the recipe it matches.
OVERLAP = {"model.optim.overlap_grad_sync": "model.overlap_grad_reduce",
           "model.optim.overlap_param_sync": "model.overlap_param_gather"}
# NeMo-Launcher's fine-tuning run keys: they name the run (run.name: ${.task_name}_${.model_train_name}), so they
# are kept for those interpolations, and mean nothing else here.
RUN_NAMING = ("run.model_train_name", "run.task_name", "run.convert_name", "run.convert_dir")
# NeMo's model.peft.peft_scheme values; the others (adapter, ptuning, ia3, ...) are methods not built here.
PEFT_SCHEMES = {"lora": "lora", "none": None, None: None}

# trainer.precision (with model.megatron_amp_O2) -> precision.type
PRECISIONS = {("bf16", True): "mixed_precision", ("bf16-mixed", True): "mixed_precision",
              ("bf16", False): "autocast", ("bf16-mixed", False): "autocast", (32, False): "fp32", (32, True): "fp32",
              ("32", False): "fp32", ("32", True): "fp32"}


def is_nemo(data: dict[str, Any]) -> bool:
    """NeMo-Launcher's training files have run/trainer/model with the layout keys under model."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    return "distributed_strategy" not in data and "model_source" not in data and \
        ("hydra" in data or "run" in data) and "tensor_model_parallel_size" in model


def nemo_stage(data: dict[str, Any]) -> tuple[str, str]:
    """The stage a NeMo-Launcher file configures, and the key that says so: LoRA (model.peft.peft_scheme: lora) is
    the peft stage; starting weights or chat data (model.restore_from_path, model.data.train_ds) fine_tuning."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    peft = model.get("peft") if isinstance(model.get("peft"), dict) else {}
    if str(peft.get("peft_scheme")).lower() == "lora":
        return "peft", "model.peft.peft_scheme: lora"
    data = model.get("data") if isinstance(model.get("data"), dict) else {}
    if model.get("restore_from_path") is not None:
        return "fine_tuning", "model.restore_from_path"
    if data.get("train_ds") is not None:
        return "fine_tuning", "model.data.train_ds"
    return "training", ""


def map_keys(flat: dict[str, Any], ours: set[str], put, row, error, warn_key) -> None:
    """Sort every key of a flattened NeMo file: ours (unchanged), mapped, ignored or refused."""
    amp_o2 = bool(flat.get("model.megatron_amp_O2", False))
    for key, value in flat.items():
        if key in RUN_NAMING:
            put(key, value)
            row(key, value, "kept: NeMo-Launcher names the run with it")
        elif key in LORA_MAPPED:
            put(LORA_MAPPED[key], value)
            row(key, value, f"training.{LORA_MAPPED[key]}")
        elif key in OVERLAP:  # on by default here, as in NeMo: only a false is written
            if value is False:
                put(OVERLAP[key], False)
            row(key, value, f"training.{OVERLAP[key]}" if value is False else
                f"the default here (training.{OVERLAP[key]}: true)")
        elif key == "model.peft.peft_scheme":
            if value not in PEFT_SCHEMES:
                error(key, f"{value!r} is not built here: LoRA (lora) is, or none for full fine-tuning")
                continue
            put(key, PEFT_SCHEMES[value])
            row(key, value, f"training.{key}")
        elif key == "model.restore_from_path" and str(value).endswith(".nemo"):
            error(key, f"{value!r}: a .nemo archive is not read here; give the Hugging Face model directory it was "
                       "converted from, or a checkpoint of ours")
        elif key == "trainer.precision":
            target = PRECISIONS.get((value, amp_o2))
            if target is None:
                error(key, f"{value!r} has no counterpart here (fp16 is not supported); use bf16 or 32")
                continue
            put("precision.type", target)
            row(key, value, f"training.precision.type = {target!r}")
        elif key == "model.optim.name" and value == "distributed_fused_adam":
            # AdamW whose state is sharded over data parallelism: AdamW with ZeRO-1 here.
            put("model.optim.name", "adamw")
            put("model.zero1", True)
            row(key, value, "training.model.optim.name = 'adamw' and training.model.zero1 = True")
        elif key == "model.resume_from_checkpoint":
            put("exp_manager.resume_from_checkpoint", value)
            row(key, value, "training.exp_manager.resume_from_checkpoint")
        elif key in ours:
            put(key, value)
            row(key, value, f"training.{key}")
        elif (entry := longest_prefix(key, IGNORED)) is not None:
            fine, why = IGNORED[entry]
            if fine is None or value in fine:
                row(key, value, "ignored: " + why)
                warn_key(key)
            else:
                error(key, f"{value!r} is not supported ({why}); remove it or use {' or '.join(map(repr, fine))}")
        else:
            error(key, "is not a key nxdt-launch knows")


def longest_prefix(key: str, table) -> str | None:
    """The entry of `table` that is `key` or its nearest parent (`a.b.c` -> `a.b.c`, else `a.b`, else `a`)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return ".".join(parts[:i])
    return None
