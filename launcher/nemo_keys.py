"""NeMo-Launcher's keys and what each becomes here: the tables launcher/nemo_config.py's map_keys reads (the keys
ignored, with the values that change nothing and the reason; LoRA's sizes and the overlap switches mapped; the run
naming keys kept; the PEFT schemes and precisions that have a counterpart) and NeMo's architecture switches.
"""

from __future__ import annotations

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
    "model.fsdp_sharding_strategy": (None, "read with model.fsdp (full: ZeRO-3, grad: ZeRO-2, hybrid: ZeRO-3 "
                                           "within a node)"),
    "model.fsdp_grad_reduce_dtype": (None, "gradients are reduced in fp32"),
    "model.fsdp_sharded_checkpoint": (None, "checkpoints are always sharded, and reshard to any layout"),
    "model.fsdp_use_orig_params": (None, "parameters keep their names and shapes (views of the flat buffers)"),
    "model.overlap_p2p_comm": (None, "the pipeline schedule's own choice"),
    "model.batch_p2p_comm": (None, "the pipeline schedule's own choice"),
    "model.tokenizer.delimiter": (None, "used by NeMo's tabular tokenizer only"),
    "model.tokenizer.use_fast": (None, "a tokenizer.json is read by Hugging Face tokenizers; slow and fast alike"),
    "model.tokenizer.sentencepiece_legacy": (None, "the SentencePiece model is read as a tokenizer.json"),
    "model.native_amp_init_scale": (None, "fp16 loss scaling; bf16 needs none"),
    "model.native_amp_growth_interval": (None, "fp16 loss scaling; bf16 needs none"),
    "model.hysteresis": (None, "fp16 loss scaling; bf16 needs none"),
    "model.fp32_residual_connection": ((False,), "residuals keep the parameter dtype"),
    "model.fp16_lm_cross_entropy": ((False,), "the loss is computed in fp32"),
    "model.megatron_amp_O2": (None, "with trainer.precision it selects precision.type"),
    "model.grad_allreduce_chunk_size_mb": (None, "collectives are bucketed by the runtime"),
    "model.sharp": ((False,), "an NCCL network option"),
    "model.mcore_gpt": (None, "one model implementation here"),
    "model.transformer_engine": (None, "Transformer Engine is NeMo's kernels; fp8 (model.fp8) is what would change "
                                       "the math"),
    "model.fp8": ((False,), "fp8 is not supported"),
    "model.fp8_e4m3": (None, "fp8 is off"),
    "model.fp8_hybrid": (None, "fp8 is off"),
    "model.fp8_margin": (None, "fp8 is off"),
    "model.fp8_interval": (None, "fp8 is off"),
    "model.fp8_amax_history_len": (None, "fp8 is off"),
    "model.fp8_amax_compute_algo": (None, "fp8 is off"),
    "model.fp8_wgrad": (None, "fp8 is off"),
    "model.ub_tp_comm_overlap": (None, "NeMo's userbuffer overlap of tensor-parallel communication"),
    "model.ub_tp_comm_overlap_cfg": (None, "NeMo's userbuffer overlap of tensor-parallel communication"),
    "model.reduce_amax": (None, "fp8 is off"),
    "model.sync_batch_comm": (None, "the pipeline schedule's own choice"),
    "model.use_cpu_initialization": (None, "weights are initialized on the host, then sharded"),
    "model.onnx_safe": (None, "no ONNX export"),
    "model.apex_transformer_log_level": (None, "no apex"),
    "model.nsys_profile": (None, "no Nsight profiling hooks"),
    "model.optim.bucket_cap_mb": (None, "gradient buckets are sized by the runtime"),
    "model.optim.contiguous_grad_buffer": (None, "gradients live in flat buckets already"),
    "model.optim.contiguous_param_buffer": (None, "a buffer layout of NeMo's distributed optimizer"),
    "model.optim.grad_sync_dtype": (None, "gradients are reduced in fp32 here, at least as precise"),
    # NeMo's implementation choices in its current files: kernels, memory, profiling.
    "model.gc_interval": (None, "Python garbage collection timing"),
    "model.apply_rope_fusion": (None, "kernel choice"),
    "model.cross_entropy_loss_fusion": (None, "kernel choice"),
    "model.get_attention_mask_from_fusion": (None, "kernel choice"),
    "model.use_flash_attention": (None, "kernel choice"),
    "model.use_emha": (None, "kernel choice"),
    "model.deterministic_mode": (None, "kernel choice"),
    "model.defer_embedding_wgrad_compute": (None, "when the embedding's weight gradient is computed"),
    "model.wgrad_deferral_limit": (None, "when the embedding's weight gradient is computed"),
    "model.moe_grouped_gemm": (None, "kernel choice"),
    "model.moe_token_dispatcher_type": (None, "how tokens reach their experts' ranks, not where they go"),
    "model.fsdp_use_orig_params": (None, "FSDP is not built"),
    "exp_manager.seconds_to_sleep": (None, "a pause before NeMo's processes exit"),
    # What the architecture built here always does: any other value would change the model.
    "model.headscale": ((False,), "no head scaling"),
    "model.openai_gelu": ((False,), "the tanh GELU of GPT, or SwiGLU"),
    "model.normalize_attention_scores": ((True,), "scores are divided by sqrt(head size)"),
    "model.attention_type": (("multihead",), "causal multi-head attention"),
    "model.transformer_block_type": (("pre_ln",), "pre-norm blocks"),
    "model.rotary_percentage": ((1.0, 1), "rotary embeddings cover each whole head"),
    "model.use_scaled_init_method": ((True,), "layers writing into the residual stream get std / sqrt(2 x layers)"),
    "model.do_layer_norm_weight_decay": ((False,), "norm weights and biases get no weight decay"),
    "model.seq_len_interpolation_factor": ((None,), "no position interpolation"),
    "model.mcore_customization_config.new_decoder_architecture": ((False,), "Falcon's decoder is not built"),
    "model.mcore_customization_config.parallel_attention": ((False,), "attention and MLP run one after the other"),
    "model.data.data_impl": (("mmap",), "Megatron's mmap indexed format is the one read"),
    "model.data.skip_warmup": (None, "no page-cache warmup"),
    "model.data.dataloader_type": (("single",), "one pass over the sample index"),
    "model.data.eod_mask_loss": ((False,), "the end-of-document token is trained on"),
    # Fine-tuning (NeMo-Launcher's fine_tuning and peft stages).
    "name": (None, "NeMo's experiment name; the run is named by run.name"),
    "exp_manager.checkpoint_callback_params.save_best_model": (None, "checkpoints are kept newest-first (save_top_k)"),
    "exp_manager.create_early_stopping_callback": ((False,), "early stopping is not built: training runs "
                                                             "trainer.max_steps"),
    "exp_manager.early_stopping_callback_params": (None, "early stopping is not built"),
    "model.optim.sched.monitor": (None, "the schedule is step based"),
    "model.optim.sched.last_epoch": (None, "the schedule is step based"),
    "model.optim.sched.reduce_on_plateau": ((False,), "the schedule is step based"),
    "model.peft.adapter_tuning": (None, "settings of a PEFT scheme this file does not choose (peft_scheme)"),
    "model.peft.p_tuning": (None, "settings of a PEFT scheme this file does not choose (peft_scheme)"),
    "model.peft.ia3_tuning": (None, "settings of a PEFT scheme this file does not choose (peft_scheme)"),
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

# NeMo's architecture switches (with NeMo's defaults) -> ours: each architecture built here is one combination.
SWITCHES = {"model.normalization": "layernorm", "model.position_embedding_type": "learned_absolute",
            "model.activation": "gelu", "model.bias": True}
