# The training stage's resolved YAML (Seam 2) as small typed dataclasses.
#
# The launcher has already expanded every interpolation; this module only reads, checks and types the keys the
# trainer uses. Every mistake becomes one ValueError that names the key, the bad value and what is accepted.
# Keys the trainer does not read (run.time_limit, exp_manager.checkpoint_callback_params, ...) are left alone.
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from runtime.data.blend import parse_data_prefix
from runtime.models import ModelConfig
from runtime.parallel import ParallelDims, check_tensor_parallel

ACCELERATORS = ("cpu", "gpu", "neuron")
PRECISION_TYPES = ("fp32", "bf16SR", "mixed_precision", "mixed_precisionSR", "autocast")
OPTIMIZERS = ("adamw",)
TOKENIZER_LIBRARIES = ("huggingface",)
CHECKPOINT_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_MODULES = ("core_attention", "mlp")
_REQUIRED = object()


class _Section:
    """Typed, path-aware access to one mapping of the YAML, so errors can say `model.optim.lr`."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise ValueError(f"{path or 'the training config'} must be a mapping, got {data!r}")
        self.data, self.path = data, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _raw(self, key: str, default):
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is _REQUIRED:
            raise ValueError(f"{self._name(key)} is missing")
        return default

    def section(self, key: str, required: bool = True) -> "_Section":
        return _Section(self._raw(key, _REQUIRED if required else {}), f"{self._name(key)}")

    def int(self, key: str, default=_REQUIRED, minimum: int | None = None) -> int:
        value = self._raw(key, default)
        # YAML may hand over 2.0 for an integer; accept exact floats, reject 2.5, True and strings.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ValueError(f"{self._name(key)} {value!r} is not an integer")
        if minimum is not None and value < minimum:
            raise ValueError(f"{self._name(key)} {value!r} must be >= {minimum}")
        return int(value)

    def float(self, key: str, default=_REQUIRED, minimum: float | None = None) -> float:
        value = self._raw(key, default)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{self._name(key)} {value!r} is not a number")
        if minimum is not None and value < minimum:
            raise ValueError(f"{self._name(key)} {value!r} must be >= {minimum}")
        return float(value)

    def bool(self, key: str, default=_REQUIRED) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self._name(key)} {value!r} is not true or false")
        return value

    def choice(self, key: str, choices: tuple, default=_REQUIRED):
        value = self.data.get(key) if key in self.data else default
        if value is _REQUIRED:
            raise ValueError(f"{self._name(key)} is missing; valid: {', '.join(map(str, choices))}")
        if value not in choices:
            raise ValueError(f"{self._name(key)} {value!r} is invalid; valid: {', '.join(map(str, choices))}")
        return value


@dataclass(frozen=True)
class TrainerConfig:
    num_nodes: int
    devices: int
    accelerator: str  # cpu | gpu | neuron
    max_steps: int
    log_every_n_steps: int
    val_check_interval: int  # 0: no validation
    limit_val_batches: int  # global batches per validation
    gradient_clip_val: float  # 0: no clipping
    preflight: bool = False  # a seconds-long collective smoke test at start (runtime/preflight.py)
    preflight_timeout_s: float = 60.0


@dataclass(frozen=True)
class ParallelConfig:
    tp: int
    pp: int
    virtual_pp: int | None
    sequence_parallel: bool
    zero1: bool
    activation_checkpointing: str | None  # None | full | selective
    recompute_modules: tuple[str, ...]


@dataclass(frozen=True)
class DataConfig:
    data_prefix: Any  # [w1, p1, ...] list or a blend file / prefix path; see runtime.data.parse_data_prefix
    splits_string: str
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    index_mapping_dir: str | None
    num_workers: int


@dataclass(frozen=True)
class SchedConfig:
    name: str
    warmup_steps: int
    constant_steps: int
    min_lr: float
    max_steps: int


@dataclass(frozen=True)
class OptimConfig:
    name: str
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    sched: SchedConfig


@dataclass(frozen=True)
class PrecisionConfig:
    type: str  # fp32 | bf16SR | mixed_precision | mixed_precisionSR | autocast


@dataclass(frozen=True)
class CheckpointConfig:
    """exp_manager's checkpoint keys (NeMo names where NeMo has one; docs/checkpoints.md)."""

    enabled: bool                    # exp_manager.create_checkpoint_callback
    dirpath: str                     # checkpoint_callback_params.dirpath: a path or s3://bucket/prefix
    every_n_train_steps: int         # 0: only at the end and on a signal
    save_top_k: int                  # keep the newest K complete checkpoints; -1: keep all
    save_last: bool                  # save when training ends
    async_save: bool                 # write in the background while training goes on
    load_on_one_replica: bool        # read on data-parallel replica 0 and broadcast to the others
    resume_if_exists: bool
    resume_from_checkpoint: str | None
    save_on_signal: bool             # exp_manager.create_preemption_callback: SIGUSR1/SIGTERM save and exit


@dataclass(frozen=True)
class TrainingConfig:
    run_name: str
    results_dir: Path
    trainer: TrainerConfig
    parallel: ParallelConfig
    data: DataConfig
    optim: OptimConfig
    precision: PrecisionConfig
    model: ModelConfig
    tokenizer_path: str
    tokenizer_vocab_size: int  # before padding; model.vocab_size is the padded size
    seed: int
    tensorboard: bool
    wandb: bool
    checkpoint: CheckpointConfig
    raw: dict = field(repr=False, compare=False)  # the whole YAML, for the W&B run config


def _trainer(section: _Section) -> TrainerConfig:
    val_check = section._raw("val_check_interval", 0)
    if isinstance(val_check, float) and val_check != int(val_check):
        raise ValueError(
            f"trainer.val_check_interval {val_check!r} must be a whole number of steps (fractions of an epoch "
            f"are not supported: training is step based)"
        )
    return TrainerConfig(
        num_nodes=section.int("num_nodes", 1, minimum=1),
        devices=section.int("devices", 1, minimum=1),
        accelerator=section.choice("accelerator", ACCELERATORS, "cpu"),
        max_steps=section.int("max_steps", minimum=1),
        log_every_n_steps=section.int("log_every_n_steps", 10, minimum=1),
        val_check_interval=section.int("val_check_interval", 0, minimum=0),
        limit_val_batches=section.int("limit_val_batches", 0, minimum=0),
        gradient_clip_val=section.float("gradient_clip_val", 0.0, minimum=0.0),
        preflight=section.bool("preflight", False),
        preflight_timeout_s=section.float("preflight_timeout_s", 60.0, minimum=1.0),
    )


def _parallel(model: _Section, padded_vocab: int) -> ParallelConfig:
    tp = model.int("tensor_model_parallel_size", 1, minimum=1)
    if padded_vocab % tp:
        raise ValueError(
            f"model.tensor_model_parallel_size {tp} does not divide the padded vocabulary {padded_vocab}; "
            f"choose make_vocab_size_divisible_by as a multiple of {tp}"
        )
    recompute = model._raw("activations_checkpoint_recompute", [])
    if not isinstance(recompute, (list, tuple)) or any(r not in RECOMPUTE_MODULES for r in recompute):
        raise ValueError(
            f"model.activations_checkpoint_recompute {recompute!r} is invalid; valid: a list of "
            f"{', '.join(RECOMPUTE_MODULES)}"
        )
    return ParallelConfig(
        tp=tp,
        pp=model.int("pipeline_model_parallel_size", 1, minimum=1),
        virtual_pp=model.int("virtual_pipeline_model_parallel_size", None, minimum=1)
        if model.data.get("virtual_pipeline_model_parallel_size") is not None
        else None,
        sequence_parallel=model.bool("sequence_parallel", False),
        zero1=model.bool("zero1", False),
        activation_checkpointing=model.choice("activations_checkpoint_granularity", CHECKPOINT_GRANULARITIES, None),
        recompute_modules=tuple(recompute),
    )


def _data(model: _Section, seq_length: int) -> DataConfig:
    data = model.section("data")
    data_seq = data.int("seq_length", seq_length, minimum=1)
    if data_seq != seq_length:
        raise ValueError(f"model.data.seq_length {data_seq} differs from model.encoder_seq_length {seq_length}")
    micro, global_ = model.int("micro_batch_size", minimum=1), model.int("global_batch_size", minimum=1)
    if global_ % micro:
        raise ValueError(f"model.global_batch_size {global_} is not a multiple of model.micro_batch_size {micro}")
    index_dir = data._raw("index_mapping_dir", None)
    data_prefix = data._raw("data_prefix", _REQUIRED)
    # Checked here, before any process group exists, so a wrong path is one clean error rather than one per rank.
    for entry in parse_data_prefix(data_prefix):
        for suffix in (".idx", ".bin"):
            if not Path(entry.prefix + suffix).is_file():
                raise ValueError(f"model.data.data_prefix names dataset {entry.prefix!r} but {entry.prefix}{suffix} "
                                 f"does not exist")
    return DataConfig(
        data_prefix=data_prefix,
        splits_string=str(data._raw("splits_string", "98,1,1")),
        seq_length=seq_length,
        micro_batch_size=micro,
        global_batch_size=global_,
        index_mapping_dir=str(index_dir) if index_dir is not None else None,
        num_workers=data.int("num_workers", 0, minimum=0),
    )


def _optim(model: _Section, max_steps: int) -> OptimConfig:
    optim = model.section("optim")
    betas = optim._raw("betas", [0.9, 0.999])
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(
        isinstance(b, (int, float)) and 0 <= b < 1 for b in betas
    ):
        raise ValueError(f"model.optim.betas {betas!r} is invalid; expected [beta1, beta2] each in [0, 1)")
    sched = optim.section("sched", required=False)
    sched_max = sched.int("max_steps", max_steps, minimum=1)
    return OptimConfig(
        name=optim.choice("name", OPTIMIZERS, "adamw"),
        lr=optim.float("lr", minimum=0.0),
        weight_decay=optim.float("weight_decay", 0.0, minimum=0.0),
        betas=(float(betas[0]), float(betas[1])),
        eps=optim.float("eps", 1e-8, minimum=0.0),
        sched=SchedConfig(
            name=str(sched._raw("name", "Constant")),
            warmup_steps=sched.int("warmup_steps", 0, minimum=0),
            constant_steps=sched.int("constant_steps", 0, minimum=0),
            min_lr=sched.float("min_lr", 0.0, minimum=0.0),
            max_steps=sched_max,
        ),
    )


def _model_keys(model: _Section, seq_length: int) -> dict:
    """The model-shape keys, type-checked here so the models package only sees well-typed values."""
    keys = dict(model.data)
    keys["architecture"] = model.choice("architecture", ("gpt", "llama"))
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
        keys[key] = model.int(key, minimum=1)
    keys["max_position_embeddings"] = model.int("max_position_embeddings", seq_length, minimum=1)
    keys["make_vocab_size_divisible_by"] = model.int("make_vocab_size_divisible_by", 128, minimum=1)
    keys["seed"] = model.int("seed", 1234)
    if model.data.get("num_query_groups") is not None:
        keys["num_query_groups"] = model.int("num_query_groups", minimum=1)
    for key in ("rotary_base", "layernorm_epsilon", "init_method_std", "hidden_dropout", "attention_dropout"):
        if model.data.get(key) is not None:
            keys[key] = model.float(key, minimum=0.0)
    if model.data.get("share_embeddings_and_output_weights") is not None:
        keys["share_embeddings_and_output_weights"] = model.bool("share_embeddings_and_output_weights")
    return keys


def parse_model_config(model_section: Any, tokenizer_path: str) -> ModelConfig:
    """Only the model's shape from a `model:` section (what conversion and evaluation rebuild from a checkpoint)."""
    model = _Section(model_section, "model")
    seq_length = model.int("encoder_seq_length", model.data.get("max_position_embeddings") or _REQUIRED, minimum=1)
    return ModelConfig.from_model_section(_model_keys(model, seq_length), tokenizer_vocab_size(tokenizer_path))


def tokenizer_vocab_size(path: str) -> int:
    """Vocabulary size of a Hugging Face tokenizer.json, added tokens included."""
    if not Path(path).is_file():
        raise ValueError(f"model.tokenizer.model {path!r} does not exist (expected a tokenizer.json)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as error:  # the tokenizers library raises a bare Exception on malformed files
        raise ValueError(f"model.tokenizer.model {path!r} is not a readable tokenizer.json: {error}") from None


def _checkpoint(exp: _Section, results_dir: Path) -> CheckpointConfig:
    params = exp.section("checkpoint_callback_params", required=False)
    resume_from = exp._raw("resume_from_checkpoint", None)
    top_k = params.int("save_top_k", -1)
    if top_k == 0 or top_k < -1:
        raise ValueError(f"exp_manager.checkpoint_callback_params.save_top_k {top_k} is invalid; use a positive "
                         f"count of checkpoints to keep, or -1 to keep all")
    return CheckpointConfig(
        enabled=exp.bool("create_checkpoint_callback", True),
        dirpath=str(params._raw("dirpath", results_dir / "checkpoints")),
        every_n_train_steps=params.int("every_n_train_steps", 0, minimum=0),
        save_top_k=top_k,
        save_last=params.bool("save_last", True),
        async_save=params.bool("async_save", True),
        load_on_one_replica=params.bool("load_on_one_replica", True),
        resume_if_exists=exp.bool("resume_if_exists", False),
        resume_from_checkpoint=None if resume_from is None else str(resume_from),
        save_on_signal=exp.bool("create_preemption_callback", True),
    )


def load_training_config(path: str | os.PathLike) -> TrainingConfig:
    """Read and check the resolved training YAML the launcher wrote (Seam 1)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {str(path)!r} does not exist") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {str(path)!r} is not valid YAML: {str(error).splitlines()[0]}") from None
    return parse_training_config(raw)


def parse_training_config(raw: Any) -> TrainingConfig:
    root = _Section(raw, "")
    run, trainer_section, model = root.section("run"), root.section("trainer"), root.section("model")
    exp = root.section("exp_manager", required=False)
    precision = root.section("precision", required=False)

    trainer = _trainer(trainer_section)
    tokenizer = model.section("tokenizer")
    tokenizer.choice("library", TOKENIZER_LIBRARIES, "huggingface")
    tokenizer_path = str(tokenizer._raw("model", _REQUIRED))
    vocab = tokenizer_vocab_size(tokenizer_path)

    seq_length = model.int("encoder_seq_length", minimum=1)
    model_config = ModelConfig.from_model_section(_model_keys(model, seq_length), vocab)
    if model_config.max_position_embeddings < seq_length:
        raise ValueError(
            f"model.max_position_embeddings {model_config.max_position_embeddings} is smaller than "
            f"model.encoder_seq_length {seq_length}"
        )
    parallel = _parallel(model, model_config.vocab_size)
    # The layout checks training would hit after starting every process, done now for one clean error.
    check_tensor_parallel(model_config, parallel.tp)
    ParallelDims.infer_dp(parallel.tp, parallel.pp, trainer.num_nodes * trainer.devices, trainer.devices)
    return TrainingConfig(
        run_name=str(run._raw("name", "run")),
        results_dir=Path(str(run._raw("results_dir", _REQUIRED))),
        trainer=trainer,
        parallel=parallel,
        data=_data(model, seq_length),
        optim=_optim(model, trainer.max_steps),
        precision=PrecisionConfig(type=precision.choice("type", PRECISION_TYPES, "fp32")),
        model=model_config,
        tokenizer_path=tokenizer_path,
        tokenizer_vocab_size=vocab,
        seed=model.int("seed", 1234),
        tensorboard=exp.bool("create_tensorboard_logger", True),
        wandb=exp.bool("create_wandb_logger", False),
        checkpoint=_checkpoint(exp, Path(str(run._raw("results_dir", _REQUIRED)))),
        raw=raw,
    )
