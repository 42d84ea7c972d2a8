"""NeMo-Launcher training YAML files (e.g. its conf/training/gpt3/5b.yaml) as they are, through the same
`training=@FILE` as NxD Training's (launcher/nxdt_config.py decides which kind a file is).

A NeMo-Launcher file already speaks our keys: those pass through unchanged, with their `${base_results_dir}`,
`${data_dir}` and `${training...}` interpolations resolved in the launch config, as NeMo-Launcher resolves them.
NeMo-only keys are ignored (with the reason) when their value changes nothing here, and refused when it would.
NeMo-Launcher's fine_tuning and peft files (model.restore_from_path, model.data.train_ds / validation_ds,
model.peft) speak our keys too, apart from LoRA's sizes under model.peft.lora_tuning, which are mapped.
"""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath
from typing import Any

from runtime.schema.families import ARCHITECTURES, megatron_architecture, megatron_choices

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
    """Sort every key of a flattened NeMo file: ours (unchanged), mapped, ignored or refused. A training file whose
    model is one of our recipes' also gets that recipe's Trainium layouts (`targets`)."""
    amp_o2 = bool(flat.get("model.megatron_amp_O2", False))
    mapped: dict[str, Any] = {}  # what the file becomes, for its Trainium layouts
    refused: list[str] = []

    def keep(key: str, value: Any) -> None:
        mapped[key] = value
        put(key, value)

    def refuse(key: str, why: str) -> None:
        refused.append(key)
        error(key, why)

    handled = set()
    for group in (_defaults, _architecture, _tokenizer, _moe, _rope_scaling, _fine_tuning_data, _lora_defaults):
        handled |= group(flat, keep, row, refuse, warn_key)
    for key, value in flat.items():
        if key in handled:
            continue
        if key in RUN_NAMING:
            keep(key, value)
            row(key, value, "kept: NeMo-Launcher names the run with it")
        elif key in LORA_MAPPED:
            keep(LORA_MAPPED[key], value)
            row(key, value, f"training.{LORA_MAPPED[key]}")
        elif key in OVERLAP:  # on by default here, as in NeMo: only a false is written
            if value is False:
                keep(OVERLAP[key], False)
            row(key, value, f"training.{OVERLAP[key]}" if value is False else
                f"the default here (training.{OVERLAP[key]}: true)")
        elif key == "model.peft.peft_scheme":
            if value not in PEFT_SCHEMES:
                refuse(key, f"{value!r} is not built here: LoRA (lora) is, or none for full fine-tuning")
                continue
            keep(key, PEFT_SCHEMES[value])
            row(key, value, f"training.{key}")
        elif key == "model.restore_from_path" and (str(value).endswith(".nemo") or value == "???"):
            what = "a .nemo archive is not read here" if value != "???" else "is required (NeMo's ???)"
            refuse(key, f"{value!r}: {what}; give the Hugging Face model directory it was converted from, or a "
                        "checkpoint of ours")
        elif key == "trainer.precision":
            target = PRECISIONS.get((value, amp_o2))
            if target is None:
                refuse(key, f"{value!r} has no counterpart here (fp16 is not supported); use bf16 or 32")
                continue
            keep("precision.type", target)
            row(key, value, f"training.precision.type = {target!r}")
        elif key == "model.precision":  # NeMo copies trainer.precision here
            if value != flat.get("trainer.precision"):
                refuse(key, f"{value!r} differs from trainer.precision {flat.get('trainer.precision')!r}; NeMo "
                            "trains in trainer.precision: make them equal")
                continue
            row(key, value, "the same as trainer.precision")
        elif key == "model.optim.name" and value in ("distributed_fused_adam", "mcore_distributed_optim"):
            # AdamW whose state is sharded over data parallelism (apex's, or Megatron-core's distributed
            # optimizer in the current files): AdamW with ZeRO-1 here.
            keep("model.optim.name", "adamw")
            keep("model.zero1", True)
            row(key, value, "training.model.optim.name = 'adamw' and training.model.zero1 = True")
        elif key == "model.resume_from_checkpoint":
            keep("exp_manager.resume_from_checkpoint", value)
            row(key, value, "training.exp_manager.resume_from_checkpoint")
        elif key in ours:
            keep(key, value)
            row(key, value, f"training.{key}")
        elif (entry := longest_prefix(key, IGNORED)) is not None:
            fine, why = IGNORED[entry]
            if fine is None or value in fine:
                row(key, value, "ignored: " + why)
                warn_key(key)
            else:
                refuse(key, f"{value!r} is not supported ({why}); remove it or use {' or '.join(map(repr, fine))}")
        else:
            refuse(key, "is not a key nxdt-launch knows")
    if not refused and not _fine_tuning(flat):
        _trainium_targets(flat, mapped, put, row)


# Each function below owns a group of keys: it maps or refuses them and returns the keys it owned.

def _defaults(flat, put, row, error, warn_key) -> set[str]:
    """NeMo's defaults list: `_self_`, and `tp_overlap@model.ub_tp_comm_overlap_cfg` (its userbuffer overlap tuning,
    an implementation choice); any other entry composes a NeMo config this file does not show."""
    if "defaults" not in flat:
        return set()
    entries = flat["defaults"] if isinstance(flat["defaults"], list) else [flat["defaults"]]
    others = [e for e in entries if e != "_self_" and "tp_overlap@model.ub_tp_comm_overlap_cfg" not in str(e)]
    if others:
        error("defaults", f"{others!r} composes NeMo configs whose keys this file does not show, which are not read "
                          "here: copy their keys into the file and remove those entries")
    else:
        row("defaults", flat["defaults"], "ignored: the userbuffer overlap tuning NeMo composes (tp_overlap)")
        warn_key("defaults")
    return {"defaults"}


# NeMo's architecture switches (with NeMo's defaults) -> ours: each architecture built here is one combination.
SWITCHES = {"model.normalization": "layernorm", "model.position_embedding_type": "learned_absolute",
            "model.activation": "gelu", "model.bias": True}


def _architecture(flat, put, row, error, warn_key) -> set[str]:
    values = tuple(flat.get(key, default) for key, default in SWITCHES.items())
    architecture = megatron_architecture(values)
    present = [key for key in SWITCHES if key in flat]
    if architecture is None:
        error(present[0], f"with {', '.join(present[1:])}: {values} is no architecture built here: "
                          f"{megatron_choices()}; set the four to one of them")
        return set(present)
    put("model.architecture", architecture)
    for key in present:
        row(key, flat[key], f"with the other switches: training.model.architecture = {architecture!r}")
    return set(present)


TOKENIZER = ("model.tokenizer.library", "model.tokenizer.type", "model.tokenizer.model",
             "model.tokenizer.vocab_file", "model.tokenizer.merge_file")


def _tokenizer(flat, put, row, error, warn_key) -> set[str]:
    """NeMo's tokenizer -> one Hugging Face tokenizer.json (model.tokenizer.model): GPT-2's BPE (vocab_file +
    merge_file) and a SentencePiece .model as the tokenizer.json beside them, a Hugging Face tokenizer by its
    directory, or by its hub name under ${data_dir} (nothing here downloads it: a dry run says it is missing)."""
    library, kind, model = (flat.get(key) for key in TOKENIZER[:3])
    vocab = flat.get("model.tokenizer.vocab_file")
    present = {key for key in TOKENIZER if key in flat}
    if not present:
        return set()
    if library == "megatron" and kind == "GPT2BPETokenizer" and vocab:
        path, how = _beside(vocab), ("GPT-2's BPE (vocab_file + merge_file) is read as one tokenizer.json beside "
                                     "vocab_file; stages=[data_preparation] writes it from the two")
    elif library == "sentencepiece" and model:
        path, how = _beside(model), ("a SentencePiece .model is read as the tokenizer.json beside it; write it with "
                                     "transformers: LlamaTokenizerFast(vocab_file=MODEL).save_pretrained(DIR)")
    elif library == "huggingface" and (kind or model):
        name = str(kind or model)
        if _hub_name(name):
            path = f"${{data_dir}}/{name}/tokenizer.json"
            how = (f"{name!r} is a Hugging Face hub name, which nothing here downloads: `huggingface-cli download "
                   f"{name} tokenizer.json --local-dir <data_dir>/{name}`, or set training.model.tokenizer.model")
        else:
            path, how = (name if name.endswith(".json") else f"{name}/tokenizer.json"), "the tokenizer's directory"
    else:
        error(sorted(present)[0], f"{library!r} / {kind!r}: nxdt-launch reads a Hugging Face tokenizer.json; set "
                                  "model.tokenizer.library: huggingface and type to its directory")
        return present
    put("model.tokenizer.library", "huggingface")
    put("model.tokenizer.model", path)
    for key in sorted(present):
        row(key, flat[key], f"with the tokenizer's other keys: training.model.tokenizer.model = {path!r} ({how})")
    return present


def _beside(path: Any) -> str:
    return str(PurePosixPath(str(path)).parent / "tokenizer.json")


def _hub_name(name: str) -> bool:
    """`org/model` as the Hugging Face hub names a repository: not a path here."""
    return not name.startswith(("/", ".", "~", "$")) and name.count("/") == 1 and "://" not in name


def _moe(flat, put, row, error, warn_key) -> set[str]:
    """Megatron-core's moe_* keys -> model.moe. Its router takes the top-k of the logits and softmaxes them
    (normalized affinities); with an expert capacity (moe_pad_expert_input_to_capacity) tokens past it drop."""
    keys = {key for key in flat if key.startswith(("model.num_moe_experts", "model.moe_"))} - set(IGNORED)
    if not keys:
        return set()
    capacity = flat.get("model.moe_expert_capacity_factor")
    moe = {"num_experts": flat.get("model.num_moe_experts"), "top_k": flat.get("model.moe_router_topk", 2),
           "frequency": 1, "capacity_factor": capacity, "dropless": capacity is None,
           "router_aux_loss_coef": flat.get("model.moe_aux_loss_coeff", 0.0),
           "router_z_loss_coef": flat.get("model.moe_z_loss_coeff") or 0.0,
           "normalize_top_k_affinities": True, "router_activation": "softmax"}
    known = {"model.num_moe_experts", "model.moe_router_topk", "model.moe_expert_capacity_factor",
             "model.moe_aux_loss_coeff", "model.moe_z_loss_coeff", "model.moe_pad_expert_input_to_capacity"}
    # The expert bias (aux-loss-free balancing: our model.moe.score_bias and router_bias_update_rate) is built for
    # the architectures whose MoE has a selection bias, from their config.json; Megatron ignores the rate without it.
    expert_bias = {"model.moe_router_enable_expert_bias", "model.moe_router_bias_update_rate"}
    if flat.get("model.moe_router_enable_expert_bias"):
        error("model.moe_router_enable_expert_bias", "True: the expert selection bias is not built "
              "for a NeMo file's Mixtral-style MoE; import the model's config.json (training.model.model_config) and "
              "set training.model.moe.router_bias_update_rate, or set it to False")
    for key in sorted(keys & expert_bias if not flat.get("model.moe_router_enable_expert_bias") else ()):
        row(key, flat[key], "ignored: Megatron-core updates the expert bias only with "
                            "moe_router_enable_expert_bias: True")
    keys_mapped = keys - expert_bias
    for key in sorted(keys_mapped - known):
        error(key, "is a Megatron-core MoE key nxdt-launch does not know; remove it")
    if capacity is not None and flat.get("model.moe_pad_expert_input_to_capacity") is not True:
        error("model.moe_expert_capacity_factor", f"{capacity!r} without moe_pad_expert_input_to_capacity: True "
                                                  "(capacity that varies by batch) is not built; set it to True")
    for name, value in moe.items():
        put(f"model.moe.{name}", value)
    for key in sorted(keys_mapped & known):
        row(key, flat[key], "with the other moe_* keys: training.model.moe = " + repr(moe))
    return keys


# NeMo's scale_positional_embedding: Llama 3.1's RoPE scaling, as Hugging Face's config.json writes it.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _rope_scaling(flat, put, row, error, warn_key) -> set[str]:
    key = "model.scale_positional_embedding"
    if key not in flat:
        return set()
    if flat[key]:
        put("model.rope_scaling", dict(LLAMA31_ROPE))
    row(key, flat[key], f"training.model.rope_scaling = {LLAMA31_ROPE!r}" if flat[key] else "the default here")
    return {key}


# A fine-tuning split's keys that describe NeMo's own records (its squad .jsonl: input / output fields joined by a
# prompt template) and how its loader treats them.
RECORD_KEYS = ("context_key", "label_key", "prompt_template", "add_eos", "add_bos", "add_sep",
               "separate_prompt_and_response_with_newline", "truncation_field", "names", "metric", "shuffle",
               "num_workers", "memmap_workers", "pin_memory", "min_seq_length", "drop_last",
               "concat_sampling_probabilities", "index_mapping_dir", "write_predictions_to_file",
               "output_file_path_prefix", "tokens_to_generate", "global_batch_size", "micro_batch_size",
               "max_seq_length")


def _fine_tuning_data(flat, put, row, error, warn_key) -> set[str]:
    """model.data.{train,validation,test}_ds: the files and the sequence length are ours; NeMo's own records
    (context_key / label_key / prompt_template) are not read here: one line says how to convert them."""
    splits = ("model.data.train_ds.", "model.data.validation_ds.", "model.data.test_ds.")
    keys = {key for key in flat if key.startswith(splits) or key == "model.data.chat"}
    if not keys:
        return set()
    if flat.get("model.data.chat"):
        error("model.data.chat", "True: NeMo's chat records are not read here; write them as {\"messages\": [...]} "
                                 "records (.jsonl) and set it to False")
    length = flat.get("model.data.train_ds.max_seq_length")
    if isinstance(length, int):
        put("model.encoder_seq_length", length)
        put("model.data.seq_length", length)
        row("model.data.train_ds.max_seq_length", length, "training.model.encoder_seq_length and data.seq_length")
    template = {field: flat.get(f"model.data.train_ds.{field}") for field in ("context_key", "label_key",
                                                                              "prompt_template")}
    if any(template.values()):
        first = "model.data.train_ds.file_names" if "model.data.train_ds.file_names" in keys else sorted(keys)[0]
        error(first, f"holds NeMo's own records ({', '.join(f'{k} {v!r}' for k, v in template.items())}), which are "
                     "not read here: the fine_tuning and peft stages read .jsonl chat records {\"messages\": [...]} "
                     "or prompt/completion records; convert each file, e.g. `jq -c '{prompt: (.input + \" \"), "
                     "completion: .output}' train-v1.1_gpt.json > train.jsonl`, and list the new files in "
                     "model.data.train_ds.file_names and validation_ds.file_names")
        return keys
    for key in sorted(keys):
        field = key.rsplit(".", 1)[1]
        if field == "file_names" and not key.startswith(splits[2]):
            put(key, flat[key])
            row(key, flat[key], f"training.{key}")
        elif field in RECORD_KEYS or key.startswith(splits[2]) or ".metric." in key:
            row(key, flat[key], "ignored: how NeMo's loader reads its records; the test split is the evaluation "
                                "stage's")
            warn_key(key)
        else:
            error(key, "is not a key nxdt-launch knows")
    return keys


def _lora_defaults(flat, put, row, error, warn_key) -> set[str]:
    """What NeMo's LoRA does when the file leaves a size out: adapters on the fused QKV, alpha = adapter_dim."""
    if str(flat.get("model.peft.peft_scheme")).lower() != "lora":
        return set()
    tuning = "model.peft.lora_tuning."
    if f"{tuning}target_modules" not in flat:
        put("model.peft.target_modules", ["attention_qkv"])
        row(f"(not in the file) {tuning}target_modules", None, "training.model.peft.target_modules = "
                                                                "['attention_qkv'], NeMo's default")
    if f"{tuning}alpha" not in flat and f"{tuning}adapter_dim" in flat:
        put("model.peft.lora_alpha", flat[f"{tuning}adapter_dim"])
        row(f"(not in the file) {tuning}alpha", None, "training.model.peft.lora_alpha = adapter_dim, NeMo's default")
    return set()


def _fine_tuning(flat: dict[str, Any]) -> bool:
    """What nemo_stage reads: a fine_tuning or peft file, whose layout is its own on every cluster."""
    return str(flat.get("model.peft.peft_scheme")).lower() == "lora" or \
        flat.get("model.restore_from_path") is not None or any(k.startswith("model.data.train_ds.") for k in flat)


# --- Trainium layouts: the recipe whose model the file trains names them ------------------------------------------

# The keys of a Trainium layout: where the file's model runs, not what it computes.
LAYOUT = ("trainer.num_nodes", "trainer.devices", "trainer.accelerator", "model.micro_batch_size",
          "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
          "model.virtual_pipeline_model_parallel_size", "model.context_parallel_size",
          "model.expert_model_parallel_size", "model.sequence_parallel", "model.zero1",
          "model.activations_checkpoint_granularity", "model.activations_checkpoint_recompute")
# What makes two models the same model (the recipe's and the file's).
SHAPE = ("model.architecture", "model.num_layers", "model.hidden_size", "model.num_attention_heads",
         "model.encoder_seq_length", "model.moe.num_experts", "model.moe.dropless")


def _trainium_targets(flat, mapped: dict[str, Any], put, row) -> None:
    """`targets` naming, for trn1 and trn2, the file with the layout our recipe for its model uses there (registered
    as Hydra configs, as launcher/nxdt_config.py registers the file): launcher/targets.py picks one by the cluster."""
    recipe = _recipe_for(mapped)
    if recipe is None:
        return
    name, layouts = recipe
    family = ARCHITECTURES.get(mapped.get("model.architecture"),
                               ARCHITECTURES[megatron_architecture(tuple(SWITCHES.values()))]).tiny_recipe
    every = "exp_manager.checkpoint_callback_params.every_n_train_steps"
    file = dict(mapped)
    if every not in flat and isinstance(flat.get("trainer.val_check_interval"), int):
        file[every] = flat["trainer.val_check_interval"]  # as nxdt_config._map_nemo adds it
    targets: dict[str, Any] = {"gpu": None}
    for target, layout_recipe in layouts.items():
        layout = _merged(layout_recipe)
        variant = {**file, **{key: layout.get(key) for key in LAYOUT}, "targets": None}
        digest = hashlib.sha256(repr(sorted(variant.items())).encode()).hexdigest()[:10]
        targets[target] = f"_nemo_{target}_{digest}"
        _register(targets[target], family, variant)
        row(f"(implied) targets.{target}", layout_recipe,
            f"on {target}: the layout of training={layout_recipe} ({', '.join(LAYOUT)}), this file's model "
            f"being training={name}'s")
    put("targets", targets)


def _recipe_for(mapped: dict[str, Any]) -> tuple[str, dict[str, str]] | None:
    """(our recipe with the file's model, {trn1|trn2: the recipe holding its layout there}), or None."""
    from launcher.paths import conf_dir
    from launcher.targets import targets_of_file

    want = _shape(mapped)
    for path in sorted((conf_dir() / "training").glob("*/*.yaml")):
        name = f"{path.parent.name}/{path.stem}"
        own, targets = targets_of_file(name)
        if not own or not isinstance(targets, dict) or _shape(_merged(name)) != want:
            continue
        layouts = {t: targets.get(t) or name for t in ("trn1", "trn2") if t in targets}
        return name, layouts
    return None


def _shape(flat: dict[str, Any]) -> tuple:
    shape = {key: flat.get(key) for key in SHAPE}
    shape["rope scaled"] = flat.get("model.rope_scaling") is not None or \
        any(key.startswith("model.rope_scaling.") for key in flat)  # a recipe's, dotted
    if shape["model.moe.num_experts"] is None:
        shape["model.moe.dropless"] = None
    return tuple(shape.items())


def _merged(recipe: str) -> dict[str, Any]:
    """A training recipe's keys, dotted, as Hydra merges its file chain (conf/training only)."""
    from launcher.targets import _file_chain

    merged: dict[str, Any] = {}
    for text in reversed(_file_chain("training", recipe)):
        merged.update(_dotted({k: v for k, v in text.items() if k != "defaults"}))
    return merged


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _register(name: str, family: str, dotted: dict[str, Any]) -> None:
    from launcher.file_choices import store_choice

    node: dict[str, Any] = {"defaults": [f"/training/{family}@_here_", "_self_"]}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        tree = node
        for part in parents:
            tree = tree.setdefault(part, {})
        tree[leaf] = value
    store_choice("training", name, node)


def longest_prefix(key: str, table) -> str | None:
    """The entry of `table` that is `key` or its nearest parent (`a.b.c` -> `a.b.c`, else `a.b`, else `a`)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return ".".join(parts[:i])
    return None
