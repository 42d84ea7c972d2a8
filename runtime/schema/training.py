# The training stage's config as small typed dataclasses, and the one parser both sides run: the launcher on
# the composed config at launch and at --dry-run (launcher/validate.py), the runtime on the YAML the launcher
# wrote (runtime/config.py). Same input, same rules (rules.py), same lines.
#
# Files are checked according to `files`: "error" at launch and on the node, "warn" in a dry run or a remote
# launch (the cluster's file system is not here), "skip" for hypothetical layouts (estimate, autoconfig); the
# tokenizer and data are not looked for when this launch's data_preparation stage makes them (`prepared`).
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.schema import choices as C
from runtime.schema.chat import end_of_document_id
from runtime.schema import preference_pairs, records, rules
from runtime.schema.data_prefix import MissingDataPrefix, missing_datasets, parse_data_prefix, parse_list
from runtime.schema.model import (LatentAttention, MoEConfig, ModelConfig, RopeScaling, hf_model_keys,
                                  read_hf_config, tokenizer_vocab_size)
from runtime.schema.reader import REQUIRED, Report, Section, closest
from runtime.schema.safetensors_file import hf_weights_problems, tensor_shapes
from runtime.schema.training_config import (AlignmentConfig, CheckpointConfig, DataConfig, FaultToleranceConfig,
                                            LoraConfig, OptimConfig, ParallelConfig,
                                            PrecisionConfig, SchedConfig, SFTDataConfig, SizingConfig,
                                            TrainerConfig,
                                            TrainingConfig)

PREFIX = "training."
FILE_MODES = ("error", "warn", "skip")


def is_remote(path: Any) -> bool:
    """An s3:// input is staged inside the job (planned by launcher/staging.py); nothing to look at here."""
    return str(path).startswith("s3://")


class _Files:
    """File checks: errors, warnings or nothing, by mode; `prepared` inputs are made by this launch."""

    def __init__(self, report: Report, mode: str, prepared: bool = False):
        assert mode in FILE_MODES, mode
        self.report, self.mode, self.prepared = report, mode, prepared

    @property
    def checked(self) -> bool:
        return self.mode != "skip"

    @property
    def inputs_checked(self) -> bool:
        """The tokenizer and the data, which this launch's data_preparation may be about to make."""
        return self.checked and not self.prepared

    def problem(self, message: str) -> None:
        if self.mode == "error":
            self.report.error(message)
        elif self.mode == "warn":
            self.report.warn(message)


# The stage's paths the launcher and the runtime look at on the file system (the data's are under data_dir, which
# the launcher checks as a whole).
PATH_KEYS = ("run.results_dir", "exp_manager.checkpoint_callback_params.dirpath", "model.tokenizer.model")


def too_long_paths(raw: Any, p: str = PREFIX, skip: tuple[str, ...] = ()) -> list[str]:
    """rules.path_length for each of PATH_KEYS a training-like stage sets, before any file system call on them;
    a value under one of `skip` (a path already refused, e.g. base_results_dir) is that one's problem."""
    found = []
    for key in PATH_KEYS:
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, str) and not any(node.startswith(s) for s in skip) and \
                (problem := rules.path_length(node, p + key)):
            found.append(problem)
    return found


def parse_training(raw: Any, *, files: str = "error", prepared: bool = False, p: str = PREFIX,
                   vocab_size: int | None = None) -> tuple[TrainingConfig | None, Report]:
    """Read and check one training stage config. Returns the config (None if anything is wrong, or if a file it
    needs was not read) and the report.

    files: "error" (at launch, on the node), "warn" (a dry run or a remote launch) or "skip" (no file is looked
    at: estimates of hypothetical layouts). prepared: this launch's data_preparation makes the tokenizer and the
    data, so those are not looked for (a model_config still is). vocab_size: the tokenizer's, when known.
    """
    report = Report()
    root = Section(raw, p.rstrip("."), report)
    file_checks = _Files(report, files, prepared)
    run, trainer_s, model_s = root.section("run"), root.section("trainer"), root.section("model")
    exp, precision_s = root.section("exp_manager"), root.section("precision")
    for name in ("run", "trainer", "model"):
        if not root.has(name):
            report.error(f"{p}{name}: missing; every training config has run, trainer and model sections")
    for problem in too_long_paths(raw, p):
        report.error(problem)
    if report.errors:  # nothing below looks at a path no file system can hold
        return None, report

    _run_keys(run, p, report)
    _fault_tolerance(root.section("fault_tolerance"), report)
    trainer = _trainer(trainer_s, p, report)
    shape, vocab, tokenizer_path = _model_shape(model_s, p, report, file_checks, vocab_size)
    parallel = _parallel(model_s)
    stage = p.rstrip(".")
    packing_set = model_s.section("data").raw("packing", None)
    sft = _sft_data(model_s, file_checks, p, pairs=stage == "alignment")
    data = _data(model_s, shape.get("encoder_seq_length"), file_checks, p, sft_data=sft is not None)
    alignment = _alignment(root, p, shape.get("encoder_seq_length"), report) if stage == "alignment" else None
    if stage != "alignment":
        strategies = root.section("model_alignment_strategy")
        report.error(rules.alignment_stage(stage, tuple(k for k in ("dpo", "orpo") if strategies.has(k))))
    elif sft is not None:
        sft = dataclasses.replace(sft, packing=False)  # pairs are never packed (alignment_layout names the key)
    lora = parse_lora(model_s, shape.get("architecture"), p, shape.get("latent_attention"))
    peft = model_s.data.get("peft")
    scheme = peft.get("peft_scheme") if isinstance(peft, dict) else None
    if scheme in C.PEFT_SCHEMES and (problem := rules.stage_scheme(p.rstrip("."), C.PEFT_SCHEMES.canonical(scheme)
                                                                   == "lora")):
        # LoRA keys in the wrong stage: the stage is the mistake, not the keys' values.
        report.errors[:] = [e for e in report.errors if not e.startswith(f"{p}model.peft.")]
        report.error(problem)
    restore_from = _restore_from(model_s, shape, file_checks, p)
    optim = _optim(model_s, trainer.max_steps if trainer else None, p)
    precision = _precision(precision_s)
    checkpoint = _checkpoint(exp, run, p)
    seed = _seed(model_s)
    tensorboard, wandb = exp.bool("create_tensorboard_logger", True), exp.bool("create_wandb_logger", False)
    plot = exp.bool("create_metrics_plot", True)
    wandb_kwargs = _wandb_kwargs(exp, p, report)
    _unknown_model_keys(model_s, shape, report)
    if report.errors:  # the rules below need well-typed values
        return None, report

    _layout_rules(report, p, trainer, parallel, data)
    _shape_rules(report, p, shape, parallel, vocab)
    _expert_rules(report, p, trainer, parallel, shape.get("moe"))
    _context_rules(report, p, trainer, parallel, shape)
    _fine_tuning_rules(report, p, parallel, shape, sft if alignment is None else None, lora)
    if alignment is not None:
        report.error(rules.alignment_layout(parallel.context, packing_set, p))
        if sft is None:
            report.error(f"{p}model.data.train_ds.file_names: missing; list the preference files (.jsonl with "
                         f"prompt, chosen, rejected) to align on")
        if alignment.strategy == "dpo":
            report.error(rules.reference_source(alignment.precompute_ref_log_probs, lora is not None, p))
        if sft is not None and file_checks.inputs_checked and tokenizer_path and not is_remote(tokenizer_path) \
                and "encoder_seq_length" in shape:
            for name in sft.train_files + sft.validation_files:
                report.error(preference_pairs.launch_problem(name, tokenizer_path, sft.chat_template,
                                                             shape["encoder_seq_length"], alignment.max_prompt_length,
                                                             alignment.truncation_mode, p + alignment.limit_key))
    if sft is not None and sft.chat_template is None and file_checks.inputs_checked and tokenizer_path \
            and not is_remote(tokenizer_path):
        report.error(_tokenizer_template(tokenizer_path, p))
    if data is not None and data.reset_documents and file_checks.inputs_checked and tokenizer_path \
            and not is_remote(tokenizer_path) and Path(tokenizer_path).exists():
        report.error(rules.document_reset_eod(end_of_document_id(tokenizer_path), tokenizer_path, p))
    sched = optim.sched
    report.error(rules.learning_rate(optim.lr, p))
    report.error(rules.optimizer_options(optim.name, optim.momentum, optim.dampening, optim.nesterov, p))
    report.error(rules.optimizer_layout(optim.name, parallel.zero1, parallel.tp, parallel.ep, p))
    report.error(rules.min_lr(sched.min_lr, optim.lr, sched.name, p))
    report.error(rules.schedule_fits(sched.warmup_steps, sched.constant_steps, sched.max_steps, p))
    if holds := rules.schedule_holds(sched.warmup_steps, sched.constant_steps, sched.max_steps, p):
        report.warn(holds)
    if report.errors or vocab is None or "hidden_size" not in shape:
        return None, report  # a dry run without the tokenizer or model_config checks what it can, and stops here
    return TrainingConfig(
        run_name=str(run.raw("name", "run")), results_dir=Path(str(run.raw("results_dir"))),
        trainer=trainer, parallel=parallel, data=data, optim=optim, precision=PrecisionConfig(precision),
        model=ModelConfig.from_model_section(shape, vocab), tokenizer_path=tokenizer_path,
        tokenizer_vocab_size=vocab, seed=seed, tensorboard=tensorboard, wandb=wandb, wandb_kwargs=wandb_kwargs, plot=plot,
        checkpoint=checkpoint,
        raw=raw, restore_from_path=restore_from, sft=sft, lora=lora, alignment=alignment,
    ), report


def _unknown_model_keys(model: Section, shape: dict, report: Report) -> None:
    """A key under model that nothing reads (`+training.model.zero_stage=3`) is a typo or another trainer's key:
    refused as Section.done refuses one, with the keys this stage reads (those its model shape reads included)."""
    # A null key is an unset one (a recipe's num_query_groups: null is GPT's multi-head attention).
    shape_read = Section({k: v for k, v in model.data.items() if v is not None}, model.path, report)
    shape_read.seen = set(model.seen) | set(shape)
    shape_read.done()


def _seed(section: Section) -> int | None:
    value = section.int("seed", 1234)
    section.report.error(None if value is None else rules.seed(value, section.key("seed")))
    return value


def parse_model(model_raw: Any, *, files: str = "error", p: str = PREFIX) -> tuple[ModelConfig | None, Report]:
    """Only the model's shape from a training config's `model:` section (what conversion and evaluation rebuild
    from a checkpoint's recorded config); its layout keys are the training's and are not checked here."""
    report = Report()
    model = Section(model_raw, f"{p}model", report)
    shape, vocab, _ = _model_shape(model, p, report, _Files(report, files))
    if not report.errors:
        single = ParallelConfig(tp=1, pp=1, virtual_pp=None, sequence_parallel=False, zero1=False,
                                activation_checkpointing=None, recompute_modules=())
        _shape_rules(report, p, shape, single, vocab)
    if not report.errors and (vocab is None or "hidden_size" not in shape):
        report.error(f"{p}model.tokenizer.model: needed to size the vocabulary")
    if report.errors:
        return None, report
    return ModelConfig.from_model_section(shape, vocab), report


def model_shape_keys(model_raw: Any, p: str = PREFIX) -> dict[str, Any]:
    """A resolved `model:` section with the keys its config.json supplies filled in (model_config's, or the Hugging
    Face directory's in restore_from_path: the estimator's view of the shape); ValueError names the key when the
    file is here but cannot be used."""
    model = dict(model_raw or {})
    source, source_key = _model_config_source(Section(model, f"{p}model", Report()))
    if source is None or (source_key == "restore_from_path" and (is_remote(source) or not Path(source).is_file())):
        return model  # the YAML's shape (weights not on this machine: what the YAML holds)
    report = Report()
    shape, vocab, _ = _model_shape(Section(model, f"{p}model", report), p, report, _Files(report, "error"))
    if report.errors:
        raise ValueError(report.errors[0])
    return {**model, **shape, "vocab_size": vocab}


def parse_sizing(raw: Any, p: str = PREFIX) -> tuple[SizingConfig, Report]:
    """What the estimator sizes a trainer stage's run by, read as parse_training reads it but without its files,
    data or rules (the estimator ranks hypothetical layouts too): the model section, the tokenizer's path, the
    parallel layout, the batch and the precision."""
    report = Report()
    root = Section(raw, p.rstrip("."), report)
    model = root.section("model")
    tokenizer = model.section("tokenizer").raw("model", None)
    micro, global_ = _batch(model)
    precision = _precision(root.section("precision"))
    return SizingConfig(model=dict(model.data), tokenizer_path=str(tokenizer or ""), parallel=_parallel(model),
                        micro_batch_size=micro, global_batch_size=global_,
                        precision=None if precision is None else PrecisionConfig(precision)), report


def parse_precision(raw: Any, p: str = PREFIX) -> tuple[PrecisionConfig | None, Report]:
    """Only precision.type of a trainer stage's config `raw`, read without files (the Neuron job script's compiler
    flags, in a dry run too); parse_training reads it the same way."""
    report = Report()
    precision = _precision(Section(raw, p.rstrip("."), report).section("precision"))
    return (None if precision is None else PrecisionConfig(precision)), report


def _batch(model: Section) -> tuple[int | None, int | None]:
    """model.micro_batch_size and model.global_batch_size (samples per data-parallel rank, per optimizer step)."""
    return model.int("micro_batch_size", minimum=1), model.int("global_batch_size", minimum=1)


def _precision(precision: Section) -> str | None:
    return precision.choice("type", C.PRECISION_TYPES, "fp32")


def _run_keys(run: Section, p: str, report: Report) -> None:
    """run.*: the job's own keys (the launcher renders them into #SBATCH lines; the runtime reads results_dir)."""
    report.error(rules.results_dir(run.raw("results_dir", None), p))
    limit = run.raw("time_limit", None)
    report.error(rules.time_limit(limit, p))
    run.choice("dependency", C.DEPENDENCIES, C.DEFAULT_DEPENDENCY)
    signal_s = run.int("preemption_signal_s", 0)
    if signal_s is not None:
        report.error(rules.preemption_signal(signal_s, "" if limit is None else str(limit), p))
    run.int("max_restarts", 0, minimum=0)


def parse_fault_tolerance(raw: Any, p: str = PREFIX) -> tuple[FaultToleranceConfig | None, Report]:
    """Only <stage>.fault_tolerance of a trainer stage's config `raw`: what the launcher renders into the job script
    (the watchdog's timeouts, the restart loop); parse_training reads it the same way."""
    report = Report()
    return _fault_tolerance(Section(raw, p.rstrip("."), report).section("fault_tolerance"), report), report


def _fault_tolerance(s: Section, report: Report) -> FaultToleranceConfig | None:
    values = dict(
        enabled=s.bool("enabled", True),
        setup_timeout_s=s.float("setup_timeout_s", 1800, above=0),
        step_timeout_s=s.float("step_timeout_s", None, above=0),
        step_timeout_factor=s.float("step_timeout_factor", 5.0, above=1),
        step_timeout_floor_s=s.float("step_timeout_floor_s", 300, above=0),
        checkpoint_timeout_s=s.float("checkpoint_timeout_s", 1800, above=0),
        in_job_restarts=s.int("in_job_restarts", 3, minimum=0),
        requeues_on_failure=s.int("requeues_on_failure", 2, minimum=0),
        same_node_failures=s.int("same_node_failures", 2, minimum=1),
    )
    s.done()
    if any(v is None for k, v in values.items() if k != "step_timeout_s"):
        return None
    return FaultToleranceConfig(**values)


def parse_trainer(raw: Any, p: str = PREFIX) -> tuple[TrainerConfig | None, Report]:
    """Only the `trainer:` section of a trainer stage's config `raw`: what the launcher sizes the stage's job by
    (num_nodes x devices workers) and the estimator its run; parse_training reads it the same way."""
    report = Report()
    return _trainer(Section(raw, p.rstrip("."), report).section("trainer"), p, report), report


def _trainer(s: Section, p: str, report: Report) -> TrainerConfig | None:
    fraction = rules.val_check_whole(s.raw("val_check_interval", 0), p)
    report.error(fraction)
    values = dict(
        num_nodes=s.int("num_nodes", 1, minimum=1),
        devices=s.int("devices", 1, minimum=1),
        accelerator=s.choice("accelerator", C.ACCELERATORS, "cpu"),
        max_steps=s.int("max_steps", minimum=1),
        log_every_n_steps=s.int("log_every_n_steps", 10, minimum=1),
        val_check_interval=None if fraction else s.int("val_check_interval", 0, minimum=0),
        limit_val_batches=s.int("limit_val_batches", 0, minimum=0),
        gradient_clip_val=s.float("gradient_clip_val", 0.0, minimum=0.0),
        preflight=s.bool("preflight", False),
        preflight_timeout_s=s.float("preflight_timeout_s", 60.0, minimum=1.0),
    )
    return None if any(v is None for v in values.values()) else TrainerConfig(**values)


_SHAPE_INTS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")


def _model_shape(model: Section, p: str, report: Report, files: _Files,
                 known_vocab: int | None = None) -> tuple[dict, int | None, str]:
    """The typed model keys, with those a Hugging Face config.json supplies filled in, the tokenizer's vocabulary
    size (None when the file cannot be read here) and the tokenizer's path.

    The config.json is model.model_config (NxD Training's key) or, without one, that of the Hugging Face directory
    model.restore_from_path names: the model a run starts from decides its architecture and every shape and
    numeric constant. A key of the YAML that says otherwise is refused, naming both values (NxD Training lets the
    YAML win, which silently trains a different model than the one whose weights are loaded)."""
    keys: dict[str, Any] = {}
    config_vocab = None
    hf_keys: dict[str, Any] = {}
    source, source_key = _model_config_source(model)
    if source is not None and files.checked and not is_remote(source):
        try:
            hf_config = read_hf_config(str(source))
            hf_keys = hf_model_keys(hf_config)
            config_vocab = int(hf_config["vocab_size"])
        except (ValueError, TypeError, ArithmeticError, KeyError) as error:
            if Path(str(source)).exists():
                message = str(error) if isinstance(error, ValueError) else f"a value has the wrong type ({error})"
                report.error(f"{model.key(source_key)}: {source}: {message.removeprefix(repr(str(source)) + ' ')}")
            elif source_key == "model_config":  # a missing restore_from_path is _restore_from's to name
                files.problem(f"{model.key(source_key)}: {source} does not exist; point it at the model's "
                              f"Hugging Face config.json")
    overrides = _config_overrides(model, hf_keys, source, report)
    report.error(_disagreements(model, {**hf_keys, **overrides} if hf_keys else {}, source, source_key))
    # Without a config.json the YAML holds the whole shape; with one that cannot be read here (a dry run on a
    # laptop) only what the YAML holds is checked, and the rest at launch on the cluster.
    # Weights not here (a dry run elsewhere, a remote path, or a missing directory that _restore_from names): the
    # YAML's shape, when it has one, is checked as the YAML states it.
    shape_known = (source is None or bool(hf_keys)
                   or (source_key == "restore_from_path" and model.has("architecture")))
    # A fine-tuning recipe that leaves the model to its starting weights (hf/sft_demo), given none: one line naming
    # the key to set, rather than every shape key's.
    if source is None and "restore_from_path" in model.data and not any(
            model.has(key) for key in ("architecture", *_SHAPE_INTS)):
        report.error(f"{model.key('restore_from_path')}: missing, and the YAML has no shape; point it at a Hugging "
                     f"Face model directory (its config.json decides the model), or set {model.key('model_config')}")
        shape_known = False
    merged = {**{k: v for k, v in hf_keys.items() if k != "make_vocab_size_divisible_by"}, **overrides,
              **{k: v for k, v in model.data.items() if v is not None}}
    if isinstance(hf_keys.get("moe"), dict) and isinstance(model.data.get("moe"), dict):
        merged["moe"] = {**hf_keys["moe"], **model.data["moe"]}  # key by key: a YAML key keeps the others
    shape = Section(merged, model.path, report)
    if "encoder_seq_length" in merged or shape_known:
        keys["encoder_seq_length"] = shape.int("encoder_seq_length", minimum=1)
    elif "max_position_embeddings" in merged:
        keys["encoder_seq_length"] = shape.int("max_position_embeddings", minimum=1)
    seq = keys.get("encoder_seq_length")
    if shape_known:
        keys["architecture"] = shape.choice("architecture", C.ARCHITECTURES)
        for key in _SHAPE_INTS:
            keys[key] = shape.int(key, minimum=1)
    if seq is not None:
        keys["max_position_embeddings"] = shape.int("max_position_embeddings", seq, minimum=1)
    keys["make_vocab_size_divisible_by"] = shape.int("make_vocab_size_divisible_by", 128, minimum=1)
    keys["seed"] = _seed(shape)
    for key in ("num_query_groups", "kv_channels", "sliding_window"):
        if merged.get(key) is not None:
            keys[key] = shape.int(key, minimum=1)
    if merged.get("layer_types") is not None:
        keys["layer_types"] = shape.strings("layer_types")
    for key in ("rotary_base", "local_rotary_base", "softmax_scale", "layernorm_epsilon", "init_method_std",
                *rules.DROPOUTS):
        if merged.get(key) is not None:
            keys[key] = shape.float(key, minimum=0.0)
    for key in ("share_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm"):
        if merged.get(key) is not None:
            keys[key] = shape.bool(key)
    keys["moe"] = parse_moe(shape)
    keys["rope_scaling"] = parse_rope_scaling(shape)
    keys["latent_attention"] = parse_latent_attention(shape)
    keys = {k: v for k, v in keys.items() if v is not None}

    tokenizer = model.section("tokenizer")
    tokenizer.choice("library", C.TOKENIZER_LIBRARIES, "huggingface")
    # With a config.json the vocabulary comes from it; the tokenizer is then only checked against it. Starting from
    # a Hugging Face directory, its own tokenizer is the default.
    beside = Path(source).parent / "tokenizer.json" if source is not None else None
    if beside is not None and (source_key == "restore_from_path" or beside.is_file()):
        path = tokenizer.str("model", str(beside))
    else:
        path = tokenizer.str("model", None if source is not None else REQUIRED) or ""
    vocab = known_vocab
    if vocab is None and path:
        vocab = _tokenizer_vocab(path, p, files)
    if vocab is not None and known_vocab is None:
        report.error(rules.vocab_rows(vocab, tokenizer.key("model"), repr(path)))
    if config_vocab is not None:
        if vocab is not None:
            report.error(rules.tokenizer_fits(vocab, config_vocab, p))
        vocab = config_vocab  # as NxD Training builds it: the embedding has config.json's vocab_size rows
        if not model.has("make_vocab_size_divisible_by"):
            keys["make_vocab_size_divisible_by"] = hf_keys["make_vocab_size_divisible_by"]
        # The YAML's make_vocab_size_divisible_by may pad those rows further: ours, masked, trimmed on export.
        keys["unpadded_vocab_size"] = config_vocab
    return keys, vocab, path


# Keys a config.json yields that the YAML may set otherwise: the training's sequence length (config.json's
# max_position_embeddings is only its default) and the vocabulary padding (checked against config.json's size).
_YAML_DECIDES = ("encoder_seq_length", "make_vocab_size_divisible_by")
# model.moe keys that shape training, not the network: token dropping, the auxiliary losses' weights and the
# selection bias's balancing rate.
_TRAINING_CHOICES = ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate")


# What model.model_config_overrides may set over config.json: the keys NxD Training's Hugging Face models apply from
# their YAML (model.num_layers, hidden_size, rope_theta; e.g. hf_llama_7B_config's 4-layer cut of Llama 2 7B).
CONFIG_OVERRIDES = {"num_layers": "int", "hidden_size": "int", "rotary_base": "float"}


def _config_overrides(model: Section, hf_keys: dict, source: str | None, report: Report) -> dict[str, Any]:
    """model.model_config_overrides, typed: keys that win over config.json's (an NxD Training file's explicit model
    keys, launcher/nxdt_config.py), each named in a warning where it changes config.json's value. Elsewhere a YAML
    key that contradicts config.json is refused (_disagreements)."""
    overrides = model.mapping("model_config_overrides") or {}
    key = model.key("model_config_overrides")
    if overrides and source is None:
        report.error(f"{key}: there is no config.json to override (model.model_config is not set); set the model's "
                     f"keys themselves (model.{next(iter(overrides))})")
        return {}
    typed: dict[str, Any] = {}
    section = Section(overrides, key, report)
    for name in overrides:
        if name not in CONFIG_OVERRIDES:
            report.error(f"{key}.{name}: not a key that can be set over config.json; "
                         f"{closest(str(name), list(CONFIG_OVERRIDES))}valid keys here: {', '.join(CONFIG_OVERRIDES)}")
            continue
        value = (section.int(name, minimum=1) if CONFIG_OVERRIDES[name] == "int"
                 else section.float(name, above=0.0))
        if value is None:
            continue
        typed[name] = value
        if name in hf_keys and hf_keys[name] != value:
            report.warn(f"{key}.{name}: {value} replaces config.json's {hf_keys[name]} ({source}), as NxD Training "
                        f"applies its YAML's model keys over config.json")
    return typed


def _model_config_source(model: Section) -> tuple[str | None, str]:
    """(the config.json that decides the model, the key that names it): model.model_config, else the config.json of
    a local Hugging Face directory in model.restore_from_path (a checkpoint of ours has none), else None."""
    model_config = model.raw("model_config", None)
    if model_config is not None:
        return str(model_config), "model_config"
    restore = model.raw("restore_from_path", None)
    if not isinstance(restore, str) or (Path(restore).is_dir() and not (Path(restore) / "config.json").exists()):
        return None, "model_config"  # no starting weights, or a checkpoint of ours: the YAML holds the shape
    # A Hugging Face directory, or a path that cannot be looked at here (remote, or not yet there in a dry run:
    # then only what the YAML holds is checked, and the rest at launch).
    return f"{restore.rstrip('/')}/config.json", "restore_from_path"


def _disagreements(model: Section, hf_keys: dict, source: str | None, source_key: str) -> str | None:
    """One line naming every YAML key that says otherwise than config.json, with both values; None if none."""
    found: list[tuple[str, Any, Any]] = []
    for key, value in hf_keys.items():
        if key in _YAML_DECIDES or not model.has(key):
            continue
        found += _differing(key, model.data[key], value)
    if not found:
        return None
    pairs = ", ".join(f"{key} {mine!r} (config.json: {theirs!r})" for key, mine, theirs in found)
    first = model.key(found[0][0])
    keys = "the key" if len(found) == 1 else "those keys"
    more = ", ..." if len(found) > 1 else ""
    return (f"{first}: the YAML disagrees with {source} (model.{source_key}), which decides the model: {pairs}; "
            f"drop {keys} ({first}=null{more}) or use weights whose config.json says so")


def _differing(key: str, mine: Any, theirs: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(theirs, dict) and isinstance(mine, dict):  # model.moe / model.rope_scaling, key by key
        return [pair for name, value in theirs.items()
                if name not in _TRAINING_CHOICES and mine.get(name) is not None
                for pair in _differing(f"{key}.{name}", mine[name], value)]
    try:
        same = mine == theirs or (isinstance(theirs, float) and float(mine) == theirs)
    except (TypeError, ValueError):
        same = False
    return [] if same else [(key, mine, theirs)]


def _tokenizer_vocab(path: str, p: str, files: _Files) -> int | None:
    """The one rule on model.tokenizer.model's file: its vocabulary, or None when it is not read here (on S3, made
    by this launch's data_preparation, not looked at). A file that is not a tokenizer.json is an error; one that
    does not exist is a problem by `files`: an error at launch, a warning in a dry run."""
    if is_remote(path) or not files.inputs_checked:
        return None
    try:
        return tokenizer_vocab_size(path)
    except ValueError as error:
        if Path(path).exists():
            files.report.error(f"{p}model.tokenizer.model: {error}")
        else:
            files.problem(f"{p}model.tokenizer.model: {path} does not exist; prepare it first (nxdt-launch "
                          f"stages=[data_preparation], or data_preparation in this launch's stages) or point it at "
                          f"a tokenizer.json")
    return None


def tokenizer_vocab(path: str, *, files: str = "error", p: str = PREFIX) -> tuple[int | None, Report]:
    """The tokenizer file's vocabulary and what the rule above found, for a caller that needs only the vocabulary
    (autoconfig sizes its model by it before any training config exists): `files` as for parse_training."""
    report = Report()
    return _tokenizer_vocab(path, p, _Files(report, files)), report


def parse_rope_scaling(model: Section) -> RopeScaling | None:
    """model.rope_scaling with Hugging Face's keys (a Llama 3.1 config.json's rope_scaling); absent or null: none."""
    if model.raw("rope_scaling", None) is None:
        return None
    s = model.section("rope_scaling")
    rope_type = s.choice("rope_type", C.ROPE_SCALING_TYPES)
    values = dict(factor=s.float("factor", minimum=0.0))
    if rope_type == "llama3":
        values.update(low_freq_factor=s.float("low_freq_factor", 1.0, minimum=0.0),
                      high_freq_factor=s.float("high_freq_factor", 4.0, minimum=0.0),
                      original_max_position_embeddings=s.int("original_max_position_embeddings", minimum=1))
    if rope_type == "yarn":
        values.update(original_max_position_embeddings=s.int("original_max_position_embeddings", minimum=1),
                      beta_fast=s.float("beta_fast", 32.0, minimum=0.0), beta_slow=s.float("beta_slow", 1.0,
                                                                                            minimum=0.0),
                      truncate=s.bool("truncate", True))
        optional = {key: s.float(key, None, minimum=0.0) for key in ("mscale", "mscale_all_dim", "attention_factor")}
        values.update({key: value for key, value in optional.items() if value is not None})
    if rope_type is None or any(v is None for v in values.values()):
        return None  # reported
    scaling = RopeScaling(rope_type=rope_type, **values)
    for problem in rules.rope_scaling(scaling, s.path):
        model.report.error(problem)
    return scaling


def parse_latent_attention(model: Section) -> LatentAttention | None:
    """model.latent_attention (multi-head latent attention) with Hugging Face's keys; absent or null: none."""
    if model.raw("latent_attention", None) is None:
        return None
    s = model.section("latent_attention")
    values = {key: s.int(key, minimum=1) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                    "v_head_dim")}
    values.update(q_lora_rank=s.int("q_lora_rank", None, minimum=1), rope_interleave=s.bool("rope_interleave", True))
    if any(v is None for k, v in values.items() if k != "q_lora_rank"):
        return None  # reported
    return LatentAttention(**values)


def parse_moe(model: Section) -> MoEConfig | None:
    """model.moe with NxD Training's keys; absent, null or num_experts 0: a dense model."""
    if model.raw("moe", None) is None:
        return None
    s = model.section("moe")
    num_experts = s.int("num_experts", 0, minimum=0)
    rate = s.float("router_bias_update_rate", 0.0, minimum=0.0)
    if not num_experts:
        if rate:
            model.report.error(f"{s.key('router_bias_update_rate')}: {rate} updates the expert selection bias of MoE "
                               f"layers, which a dense model (num_experts {num_experts}) has none of; set it to 0.0")
        return None
    values = dict(top_k=s.int("top_k", 2), frequency=s.int("frequency", 1),
                  capacity_factor=s.float("capacity_factor", None), dropless=s.bool("dropless", False),
                  router_aux_loss_coef=s.float("router_aux_loss_coef", 0.0, minimum=0.0),
                  router_z_loss_coef=s.float("router_z_loss_coef", 0.0, minimum=0.0),
                  normalize_top_k_affinities=s.bool("normalize_top_k_affinities", True),
                  router_activation=s.str("router_activation", "softmax"),
                  ffn_hidden_size=s.int("ffn_hidden_size", None, minimum=1), layers=s.raw("layers", None),
                  score_bias=s.bool("score_bias", False), groups=s.int("groups", 1, minimum=1),
                  top_groups=s.int("top_groups", 1, minimum=1),
                  routed_scaling_factor=s.float("routed_scaling_factor", 1.0, minimum=0.0),
                  shared_ffn_hidden_size=s.int("shared_ffn_hidden_size", None, minimum=1),
                  router_bias_update_rate=rate)
    optional = ("capacity_factor", "ffn_hidden_size", "layers", "shared_ffn_hidden_size")
    if any(v is None for k, v in values.items() if k not in optional):
        return None  # reported
    if values["layers"] is not None:
        if not isinstance(values["layers"], (list, tuple)) or not all(isinstance(i, int) for i in values["layers"]):
            model.report.error(f"{s.key('layers')}: {values['layers']!r} must be a list of layer indexes")
            return None
        values["layers"] = tuple(values["layers"])
    dropless = values.pop("dropless")
    if dropless:
        values["capacity_factor"] = None  # NxD Training's dropless: no capacity, whatever capacity_factor says
    return MoEConfig(num_experts=num_experts, **values)


def _parallel(model: Section) -> ParallelConfig | None:
    recompute = model.raw("activations_checkpoint_recompute", [])
    modules: list[str] = []
    if not isinstance(recompute, (list, tuple)):
        model.report.error(f"{model.key('activations_checkpoint_recompute')}: {recompute!r} must be a list of "
                           f"{C.RECOMPUTE_MODULES.listing()}")
    else:
        for i, name in enumerate(recompute):
            problem = C.RECOMPUTE_MODULES.problem(model.key(f"activations_checkpoint_recompute[{i}]"), name)
            model.report.error(problem)
            if problem is None:
                modules.append(C.RECOMPUTE_MODULES.canonical(name))
    values = dict(
        tp=model.int("tensor_model_parallel_size", 1, minimum=1),
        pp=model.int("pipeline_model_parallel_size", 1, minimum=1),
        ep=model.int("expert_model_parallel_size", 1, minimum=1),
        cp=model.int("context_parallel_size", 1, minimum=1),
        ulysses=model.int("ulysses_parallel_size", 1, minimum=1),
        sequence_parallel=model.bool("sequence_parallel", False),
        zero1=model.bool("zero1", False),
        # Megatron-core's DDP names; NeMo's optim.overlap_grad_sync / overlap_param_sync map onto them.
        overlap_grad_reduce=model.bool("overlap_grad_reduce", True),  # as torch DDP and Megatron-core default
        overlap_param_gather=model.bool("overlap_param_gather", True),
    )
    vpp = model.int("virtual_pipeline_model_parallel_size", None, minimum=1)
    granularity = model.choice("activations_checkpoint_granularity", C.CHECKPOINT_GRANULARITIES, None)
    cuts = _pipeline_cuts(model)
    if any(v is None for v in values.values()):
        return None
    return ParallelConfig(virtual_pp=vpp, activation_checkpointing=granularity,
                          recompute_modules=tuple(dict.fromkeys(modules)), pipeline_cuts=cuts, **values)


def _pipeline_cuts(model: Section) -> tuple[int, ...] | None:
    """model.pipeline_cuts as layer indices: NxD Training writes module names ("model.layers.18"), a number is
    the same layer. Their count and order are the layout rule's (rules.layers_split)."""
    raw = model.raw("pipeline_cuts", None)
    if raw is None:
        return None
    cuts = []
    for item in raw if isinstance(raw, list) else [raw]:
        text = str(item).removeprefix("model.").removeprefix("layers.") if not isinstance(item, bool) else ""
        if not text.isdigit():
            model.report.error(f"{model.key('pipeline_cuts')}: {raw!r} must be a list of layer indices or names "
                               f"(model.layers.N), the last layer of each pipeline stage but the last")
            return None
        cuts.append(int(text))
    return tuple(cuts)


def _data(model: Section, seq_length: int | None, files: _Files, p: str, sft_data: bool = False
          ) -> DataConfig | None:
    data = model.section("data")
    data_seq = data.int("seq_length", seq_length, minimum=1) if seq_length else None
    if data_seq is not None and seq_length is not None:
        model.report.error(rules.data_seq_length(data_seq, seq_length, p))
    micro, global_ = _batch(model)
    index_dir = data.raw("index_mapping_dir", None)
    data_prefix = data.raw("data_prefix", None if sft_data else REQUIRED)
    model.report.error(rules.fine_tuning_data(sft_data, data_prefix is not None, p))
    key = data.key("data_prefix")
    if data_prefix is not None:
        try:
            if isinstance(data_prefix, str):
                if files.inputs_checked and not is_remote(data_prefix):
                    entries = parse_data_prefix(data_prefix, key)
                    for line in missing_datasets(entries, key):
                        files.problem(line)
            else:
                entries = parse_list(data_prefix, key)
                if files.inputs_checked:
                    for line in missing_datasets([e for e in entries if not is_remote(e.prefix)], key):
                        files.problem(line)
        except MissingDataPrefix as error:
            files.problem(str(error))
        except ValueError as error:  # malformed: an error wherever it is found
            model.report.error(str(error))
    splits = data.str("splits_string", "98,1,1")
    if splits is not None:
        model.report.error(rules.splits(splits, p))
    workers = data.int("num_workers", 0, minimum=0)
    reset = (data.bool("reset_position_ids", False), data.bool("reset_attention_mask", False))
    model.report.error(rules.document_reset(*reset, p))
    if None in (micro, global_, splits, workers) or (data_prefix is None and not sft_data) or seq_length is None:
        return None
    return DataConfig(data_prefix=data_prefix, splits_string=splits, seq_length=seq_length, micro_batch_size=micro,
                      global_batch_size=global_, index_mapping_dir=None if index_dir is None else str(index_dir),
                      num_workers=workers, reset_documents=bool(reset[0] and reset[1]))




def _sft_data(model: Section, files: _Files, p: str, pairs: bool = False) -> SFTDataConfig | None:
    """model.data.train_ds / validation_ds (NeMo's fine-tuning keys): chat or prompt/completion records, or with
    `pairs` (the alignment stage) preference records: prompt, chosen, rejected."""
    data = model.section("data")
    data.choice("truncation", C.TRUNCATIONS, "right")  # read (marked seen) even for pretraining configs
    data.raw("packing", None), data.raw("chat_template", None), data.raw("validation_ds", None)
    if data.raw("train_ds", None) is None:
        return None
    lists = {}
    for split in ("train_ds", "validation_ds"):
        section = data.section(split)
        names = section.strings("file_names") if section.data else ()
        if names is None:
            return None
        if split == "train_ds" and not names:
            model.report.error(f"{section.key('file_names')}: missing; list the .jsonl/.jsonl.gz/.parquet files to "
                               f"fine-tune on")
            return None
        for name in names:
            if not name.endswith(C.SFT_SUFFIXES):
                model.report.error(f"{section.key('file_names')}: {name!r} is not a {', '.join(C.SFT_SUFFIXES)} file")
            elif files.inputs_checked and not is_remote(name) and not Path(name).is_file():
                files.problem(f"{section.key('file_names')}: {name} does not exist; run the data_preparation that "
                              f"writes it or fix the path")
            elif files.inputs_checked and not is_remote(name):
                model.report.error(records.launch_problem(name, section.key("file_names"), pairs))
        lists[split] = tuple(names)
    template = data.str("chat_template", None)
    if template is not None and template not in C.CHAT_TEMPLATES and not Path(template).is_file():
        model.report.error(f"{data.key('chat_template')}: {template!r} is neither a built-in template "
                           f"({', '.join(C.CHAT_TEMPLATES)}) nor a jinja2 file; null uses the tokenizer's own")
        return None
    values = dict(packing=data.bool("packing", True), truncation=data.choice("truncation", C.TRUNCATIONS, "right"))
    if pairs:  # the alignment stage only (elsewhere the key is unknown); a bad value is already reported
        values["identical_pairs"] = data.choice("identical_pairs", preference_pairs.IDENTICAL_PAIRS, "error") or "error"
    if any(v is None for v in values.values()):
        return None
    return SFTDataConfig(train_files=lists["train_ds"], validation_files=lists["validation_ds"],
                         chat_template=template, **values)


def _alignment(root: Section, p: str, seq_length: int | None, report: Report) -> AlignmentConfig | None:
    """strategy and model_alignment_strategy.<strategy> (NxD Training's section; the strategy is also read from
    which subsection is there, as NxD Training does)."""
    strategies = root.section("model_alignment_strategy")
    present = tuple(k for k in C.ALIGNMENT_STRATEGIES if strategies.raw(k, None) is not None)
    strategy = root.choice("strategy", C.ALIGNMENT_STRATEGIES, present[0] if len(present) == 1 else REQUIRED)
    strategies.done()
    if strategy is None:
        return None
    for other in present:
        if other != strategy:
            report.error(f"{strategies.key(other)}: set while {root.key('strategy')} is {strategy}; remove it or set "
                         f"{root.key('strategy')}={other}")
    s = strategies.section(strategy)
    if strategy == "dpo":
        beta_key, limit_key = "kl_beta", "max_dpo_prompt_length"
        loss_type = s.choice("loss_type", C.DPO_LOSS_TYPES, "sigmoid")
        precompute = s.bool("precompute_ref_log_probs", True)
    else:
        beta_key, limit_key, loss_type, precompute = "beta", "max_prompt_length", "orpo", False
    beta = s.float(beta_key, 0.1)
    limit = s.int(limit_key, (seq_length or 2) // 2)
    mode = s.choice("truncation_mode", C.PROMPT_TRUNCATIONS, "keep_start")
    s.done()
    if beta is not None:
        report.error(rules.preference_beta(beta, s.key(beta_key)))
    if limit is not None:
        report.error(rules.prompt_limit(limit, seq_length, s.key(limit_key)))
    if None in (beta, limit, mode, loss_type, precompute):
        return None
    return AlignmentConfig(strategy=strategy, beta=beta, loss_type=loss_type, max_prompt_length=limit,
                           truncation_mode=mode, precompute_ref_log_probs=precompute)


def parse_lora(model: Section, architecture: str | None, p: str, latent: LatentAttention | None = None
               ) -> LoraConfig | None:
    """model.peft (NxD Training's keys): peft_scheme lora, lora_rank, lora_alpha, lora_dropout, target_modules.
    `latent` (model.latent_attention) decides the names on multi-head latent attention, where a group's q, k and v
    are its query and key-value projections (choices.LATENT_LORA_PARTS)."""
    if model.raw("peft", None) is None:
        return None
    peft = model.section("peft")
    if peft.choice("peft_scheme", C.PEFT_SCHEMES, None) is None:
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules"):
            peft.raw(key, None)
        return None
    rank = peft.int("lora_rank", 16)
    alpha = peft.float("lora_alpha", 32.0)
    dropout = peft.float("lora_dropout", 0.0)
    targets = peft.strings("target_modules")
    if None in (rank, alpha, dropout, targets):
        return None
    problems = [rules.lora_rank(rank, p), rules.lora_alpha(alpha, p), rules.lora_dropout(dropout, p),
                rules.lora_targets(targets, architecture, p, latent)]
    for problem in problems:
        model.report.error(problem)
    if any(problems):
        return None
    parts = C.LATENT_LORA_PARTS if latent is not None else {}
    modules = rules.lora_modules(architecture, latent)
    expanded = []
    for name in targets:
        if name not in C.LORA_GROUPS:
            expanded.append(name)
            continue
        # A group keeps the names this model has (GPT's MLP input is up_proj; latent attention's by q_lora_rank).
        members = [m for member in C.LORA_GROUPS[name] for m in parts.get(member, (member,))]
        expanded += [m for m in members if m in modules]
    return LoraConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(dict.fromkeys(expanded)))


def saved_lora(model: dict, cfg: ModelConfig | None = None) -> tuple[LoraConfig | None, Report]:
    """A saved training config's LoRA (its `model:` section), with its targets as the model `cfg` names them when
    given (the saved YAML may leave the architecture to the config.json of its restore_from_path)."""
    report = Report()
    architecture, latent = (model.get("architecture"), None) if cfg is None else (cfg.architecture,
                                                                                  cfg.latent_attention)
    return parse_lora(Section(model, "model", report), architecture, "", latent), report


_RESTORE_SHAPE = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups")


def _restore_from(model: Section, shape: dict, files: _Files, p: str) -> str | None:
    """model.restore_from_path: the weights fine-tuning starts from (NeMo's key; NxD Training's is
    exp_manager.resume_from_checkpoint with model.weight_init_only). A Hugging Face directory is checked against
    the model keys here, before anything is submitted; a checkpoint of ours when it is loaded."""
    path = model.str("restore_from_path", None)
    if path is None or not files.inputs_checked or is_remote(path):
        return path
    key = model.key("restore_from_path")
    directory = Path(path)
    if not directory.exists():
        files.problem(f"{key}: {path} does not exist; point it at a Hugging Face model directory or a checkpoint")
        return path
    if not (directory / "config.json").is_file():
        return path  # a checkpoint of ours (runtime/finetune.py reads and checks it)
    # Headers only: a truncated download fails here, not in every worker after the queue wait.
    problems = hf_weights_problems(directory)
    for problem in problems:
        model.report.error(f"{key}: {problem}; re-download it, or point {key} at a complete copy")
    if not problems and shape.get("unpadded_vocab_size") is not None:  # the rows a launch loads and pads
        model.report.error(rules.weights_vocab(tensor_shapes(directory), shape["unpadded_vocab_size"], key,
                                               str(_model_config_source(model)[0])))
    if _model_config_source(model)[1] == "restore_from_path":
        return path  # its config.json decided the model keys (_model_shape), and named what it could not read
    try:
        theirs = hf_model_keys(read_hf_config(str(directory / "config.json")))
    except (ValueError, TypeError, KeyError) as error:
        model.report.error(f"{key}: {directory / 'config.json'}: {error}")
        return path
    for name in _RESTORE_SHAPE:
        mine = shape.get(name) if name != "num_query_groups" else shape.get(name) or shape.get("num_attention_heads")
        other = theirs.get(name) if name != "num_query_groups" else theirs.get(name) or theirs.get(
            "num_attention_heads")
        if mine is not None and other is not None and mine != other:
            model.report.error(f"{key}: {path} holds a model with {name} {other} but model.{name} is {mine} (from "
                               f"model.model_config); drop model.model_config so that the weights' own config.json "
                               f"decides, or choose weights of this model")
            break
    return path


def _optim(model: Section, max_steps: int | None, p: str) -> OptimConfig | None:
    optim = model.section("optim")
    betas = optim.raw("betas", [0.9, 0.999])
    model.report.error(rules.betas(betas, p))
    sched = optim.section("sched")
    values = dict(name=optim.choice("name", C.OPTIMIZERS, "adamw"), lr=optim.float("lr"),
                  weight_decay=optim.float("weight_decay", 0.0, minimum=0.0), eps=optim.float("eps", 1e-8, minimum=0.0),
                  momentum=optim.float("momentum", 0.0, minimum=0.0), dampening=optim.float("dampening", 0.0, minimum=0.0),
                  nesterov=optim.bool("nesterov", False))
    sched_values = dict(
        name=sched.choice("name", C.SCHEDULES, "Constant"),
        warmup_steps=sched.int("warmup_steps", 0, minimum=0),
        constant_steps=sched.int("constant_steps", 0, minimum=0),
        min_lr=sched.float("min_lr", 0.0, minimum=0.0),
        max_steps=sched.int("max_steps", max_steps, minimum=1) if max_steps is not None else None,
    )
    if any(v is None for v in (*values.values(), *sched_values.values())) or model.report.errors:
        return None
    return OptimConfig(betas=(float(betas[0]), float(betas[1])), sched=SchedConfig(**sched_values), **values)


def _checkpoint(exp: Section, run: Section, p: str) -> CheckpointConfig | None:
    params = exp.section("checkpoint_callback_params")
    top_k = params.int("save_top_k", -1)
    if top_k is not None:
        exp.report.error(rules.save_top_k(top_k, p))
    resume_from = exp.raw("resume_from_checkpoint", None)
    results_dir = run.raw("results_dir", "")
    values = dict(
        enabled=exp.bool("create_checkpoint_callback", True),
        dirpath=str(params.raw("dirpath", Path(str(results_dir)) / "checkpoints")),
        every_n_train_steps=params.int("every_n_train_steps", 0, minimum=0),
        save_top_k=top_k,
        save_last=params.bool("save_last", True),
        async_save=params.bool("async_save", True),
        load_on_one_replica=params.bool("load_on_one_replica", True),
        resume_if_exists=exp.bool("resume_if_exists", False),
        save_on_signal=exp.bool("create_preemption_callback", True),
    )
    if any(v is None for v in values.values()):
        return None
    return CheckpointConfig(resume_from_checkpoint=None if resume_from is None else str(resume_from), **values)


def _layout_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig, data: DataConfig | None):
    tp, pp, vpp = parallel.tp, parallel.pp, parallel.virtual_pp
    world = trainer.num_nodes * trainer.devices
    report.error(rules.world_divisible(world, rules.world_text(trainer.num_nodes, trainer.devices), tp, pp, p))
    report.error(rules.tp_within_node(tp, trainer.devices, p))
    report.error(rules.virtual_needs_pipeline(vpp, pp, p))
    if data is None or world % (tp * pp):
        return
    dp = world // (tp * pp)
    if dp % parallel.context:
        return  # the context rules say so
    dp //= parallel.context  # ranks splitting one sequence read the same samples
    problem = rules.global_batch(data.global_batch_size, data.micro_batch_size, dp, p)
    report.error(problem)
    if not problem and vpp and vpp > 1:
        micro_batches = data.global_batch_size // (data.micro_batch_size * dp)
        report.error(rules.interleaved_micro_batches(micro_batches, pp, p))


def _shape_rules(report: Report, p: str, shape: dict, parallel: ParallelConfig, vocab: int | None) -> None:
    tp = parallel.tp
    seq = shape.get("encoder_seq_length")
    if seq and shape.get("max_position_embeddings"):
        report.error(rules.positions(shape["max_position_embeddings"], seq, p))
    if shape.get("make_vocab_size_divisible_by"):
        problem = rules.vocab_tp(vocab, shape["make_vocab_size_divisible_by"], tp, p)
        if problem and vocab is None:
            report.warn(problem)  # only the tokenizer can decide; the node has it
        else:
            report.error(problem)
    for name in rules.DROPOUTS:
        if name in shape:
            report.error(rules.dropout(name, shape[name], p))
    if "hidden_size" not in shape:
        return  # model_config not readable here (a dry run): the shape is checked at launch
    heads = shape["num_attention_heads"]
    groups = shape.get("num_query_groups") or heads
    report.error(rules.head_size(shape["hidden_size"], heads, shape.get("kv_channels"), p))
    for problem in rules.llama_switches(shape.get("architecture"),
                                        {k: shape.get(k) for k in rules.MODEL_SWITCHES}, p):
        report.error(problem)
    report.error(rules.attention_layers(shape.get("layer_types"), shape.get("sliding_window"), shape["num_layers"], p))
    report.error(rules.heads_groups(heads, groups, p))
    report.error(rules.heads_tp(heads, tp, p))
    report.error(rules.ffn_tp(shape["ffn_hidden_size"], tp, p))
    if heads % groups == 0:
        report.error(rules.kv_heads_tp(groups, tp, p))
    report.error(rules.layers_split(shape["num_layers"], parallel.pp, parallel.virtual_pp, p, parallel.pipeline_cuts))
    moe = shape.get("moe")
    if moe is not None:
        for problem in rules.moe(shape.get("architecture"), moe.num_experts, moe.top_k, moe.frequency,
                                 shape["num_layers"], moe.capacity_factor, moe.router_activation, p,
                                 layers=moe.layers, ffn=moe.ffn_hidden_size, ffn_dropout=shape.get("ffn_dropout"),
                                 groups=(moe.groups, moe.top_groups)):
            report.error(problem)
        if moe.ffn_hidden_size:
            report.error(rules.ffn_tp(moe.ffn_hidden_size, tp, p, "moe.ffn_hidden_size"))
        report.error(rules.bias_update(moe.router_bias_update_rate, moe.score_bias, p))



def _expert_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig,
                  moe: MoEConfig | None) -> None:
    world = trainer.num_nodes * trainer.devices
    if world % (parallel.tp * parallel.pp) == 0:  # otherwise the layout rules said so already
        report.error(rules.expert_layout(moe.num_experts if moe is not None else None, parallel.ep,
                                         world // (parallel.tp * parallel.pp), p))
    if moe is not None and (problem := rules.dropless_on_xla(moe.capacity_factor, trainer.accelerator, p)):
        report.warn(problem)


def _context_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig, shape: dict) -> None:
    cp, ulysses, tp = parallel.cp, parallel.ulysses, parallel.tp
    world = trainer.num_nodes * trainer.devices
    if world % (tp * parallel.pp) == 0:  # otherwise the layout rules said so already
        report.error(rules.context_layout(cp, ulysses, world // (tp * parallel.pp), p))
    if shape.get("encoder_seq_length"):
        report.error(rules.context_sequence(shape["encoder_seq_length"], cp, ulysses, tp, parallel.sequence_parallel,
                                            p))
    if "num_attention_heads" in shape:
        report.error(rules.ulysses_heads(shape["num_attention_heads"], tp, ulysses, p))
    moe = shape.get("moe")
    report.error(rules.context_architecture(moe.num_experts if moe is not None else None,
                                            shape.get("attention_dropout", 0.0) or 0.0, cp, ulysses, p))
    report.error(rules.context_window(shape.get("layer_types"), cp, ulysses, p))


def _tokenizer_template(tokenizer_path: str, p: str) -> str | None:
    """model.data.chat_template: null reads the tokenizer's own template (tokenizer_config.json beside its
    tokenizer.json, as transformers keeps it): a tokenizer without one is found here, before the job is queued."""
    import json

    tokenizer = Path(tokenizer_path)
    if not tokenizer.exists():
        return None  # model.tokenizer.model's own check names it
    config = (tokenizer if tokenizer.is_dir() else tokenizer.parent) / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except FileNotFoundError:
        template = None
    except (OSError, ValueError, AttributeError):
        return f"{p}model.data.chat_template: null reads {config}, which is not a JSON object"
    if template:
        return None
    return (f"{p}model.data.chat_template: null uses the tokenizer's own template, but {config} has no "
            f"chat_template; set model.data.chat_template to one of {', '.join(C.CHAT_TEMPLATES)}")


def _fine_tuning_rules(report: Report, p: str, parallel: ParallelConfig, shape: dict, sft: SFTDataConfig | None,
                       lora: LoraConfig | None) -> None:
    if sft is not None:
        report.error(rules.packing_context(sft.packing, parallel.context, p))
    if lora is not None:
        moe = shape.get("moe")
        report.error(rules.lora_moe(moe.num_experts if moe is not None else None, lora.target_modules, p,
                                    shape.get("latent_attention")))
        if moe is not None:
            report.error(rules.bias_update(moe.router_bias_update_rate, moe.score_bias, p, lora=True))


# NeMo's exp_manager.wandb_logger_kwargs (Lightning's WandbLogger arguments) that mean something without Lightning.
WANDB_KEYS = ("project", "name", "group", "tags", "entity", "notes", "job_type", "offline", "save_dir", "id",
              "version", "resume")


def _wandb_kwargs(exp: Section, p: str, report: Report) -> dict:
    kwargs = exp.mapping("wandb_logger_kwargs") or {}
    for key in sorted(set(kwargs) - set(WANDB_KEYS)):
        report.error(f"{p}exp_manager.wandb_logger_kwargs.{key}: not a W&B setting nxdt-launch passes on; "
                     f"valid: {', '.join(WANDB_KEYS)}")
    return {k: v for k, v in kwargs.items() if k in WANDB_KEYS}
