# The training stage's config as small typed dataclasses, and the one parser both sides run: the launcher on
# the composed config at launch and at --dry-run (launcher/validate.py), the runtime on the YAML the launcher
# wrote (runtime/config.py). Same input, same rules (rules.py), same lines.
#
# Files are checked according to `files`: "error" at launch and on the node, "warn" in a dry run or a remote
# launch (the cluster's file system is not here), "skip" for hypothetical layouts (estimate, autoconfig); the
# tokenizer and data are not looked for when this launch's data_preparation stage makes them (`prepared`).
#
# This module holds the entry points (parse_training and the parsers of one part of a stage); each section is read
# by its own module: training_run (run, trainer, fault_tolerance, precision, exp_manager), training_model (the
# model's shape and tokenizer) with training_hf (its config.json and starting weights) and training_model_parts
# (moe, rope_scaling, latent_attention), training_layout (the parallel layout), training_data, training_optim,
# training_peft, training_alignment, training_reward and training_rl; training_files says what is looked at on the
# file system.
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.schema import rules
from runtime.schema.model import ModelConfig
from runtime.schema.reader import Report, Section
from runtime.schema.stages import PAIR_STAGES
from runtime.schema.training_alignment import alignment_rules, preference_file_rules, read_stage_alignment
from runtime.schema.training_config import (AlignmentConfig, CheckpointConfig, DataConfig, FaultToleranceConfig,
                                            LoraConfig, OptimConfig, ParallelConfig, PrecisionConfig,
                                            RewardModelConfig, RLConfig, SFTDataConfig, SizingConfig, TrainerConfig,
                                            TrainingConfig)
from runtime.schema.training_data import read_batch, read_data, read_sft_data, tokenizer_rules
from runtime.schema.training_files import FILE_MODES, Files, is_remote
from runtime.schema.training_hf import model_config_source, read_restore_from
from runtime.schema.training_layout import context_rules, elastic_rules, expert_rules, layout_rules, read_parallel
from runtime.schema.training_model import (model_shape, read_seed, read_tokenizer_vocab, shape_rules,
                                           unknown_model_keys)
from runtime.schema.training_model_parts import parse_latent_attention, parse_moe, parse_rope_scaling
from runtime.schema.training_optim import optim_rules, read_optim
from runtime.schema.training_peft import fine_tuning_rules, parse_lora, read_peft, saved_lora
from runtime.schema.training_reward import read_stage_reward, reward_rules
from runtime.schema.training_rl import read_stage_rl, rl_rules
from runtime.schema.training_run import (WANDB_KEYS, read_checkpoint, read_fault_tolerance, read_precision, read_run,
                                         read_runtime, read_trainer, read_wandb_kwargs)

# The names imported from here (by the launcher, the runtime and the tests), each defined where its section is read;
# _wandb_kwargs is read_wandb_kwargs under the name tests/runtime_train/test_metrics.py imports.
_wandb_kwargs = read_wandb_kwargs
__all__ = ["FILE_MODES", "PATH_KEYS", "PREFIX", "WANDB_KEYS", "_wandb_kwargs", "is_remote", "model_shape_keys",
           "parse_fault_tolerance", "parse_latent_attention", "parse_lora", "parse_model", "parse_moe",
           "parse_precision", "parse_rope_scaling", "parse_runtime", "parse_sizing", "parse_trainer", "parse_training",
           "read_training", "saved_lora",
           "tokenizer_vocab", "too_long_paths"]

PREFIX = "training."

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
    config, _, report = read_training(raw, files=files, prepared=prepared, p=p, vocab_size=vocab_size)
    return config, report


def read_training(raw: Any, *, files: str = "error", prepared: bool = False, p: str = PREFIX,
                  vocab_size: int | None = None) -> tuple[TrainingConfig | None, SizingConfig | None, Report]:
    """parse_training, and from the same reading what the estimator sizes the run by (the launch's one parse of
    the layout: its memory check estimates from it). The sizing is None where a section could not be read; it is
    there when a dry run stops short of the config for a missing file."""
    report = Report()
    root = Section(raw, p.rstrip("."), report)
    file_checks = Files(report, files, prepared)
    run, trainer_s, model_s = root.section("run"), root.section("trainer"), root.section("model")
    exp, precision_s = root.section("exp_manager"), root.section("precision")
    for name in ("run", "trainer", "model"):
        if not root.has(name):
            report.error(f"{p}{name}: missing; every training config has run, trainer and model sections")
    for problem in too_long_paths(raw, p):
        report.error(problem)
    if report.errors:  # nothing below looks at a path no file system can hold
        return None, None, report

    read = _read(root, run, trainer_s, model_s, exp, precision_s, p=p, files=file_checks, vocab_size=vocab_size)
    if report.errors:  # the rules below need well-typed values
        return None, None, report

    _rules(read, p, file_checks, report)
    sizing = None if report.errors else read.sizing(model_s)
    if report.errors or read.vocab is None or "hidden_size" not in read.shape:
        return None, sizing, report  # a dry run without the tokenizer or model_config checks what it can, and stops
    return read.config(raw), sizing, report


@dataclasses.dataclass(frozen=True)
class _Read:
    """Every section of one training stage config, read and typed (None where a value was wrong): what the rules
    across sections check and the TrainingConfig is made of."""

    run: Section
    elastic: bool | None  # run.elastic
    trainer: TrainerConfig | None
    shape: dict
    vocab: int | None
    tokenizer_path: str
    parallel: ParallelConfig | None
    packing_set: Any  # model.data.packing as the YAML sets it (None: not set)
    sft: SFTDataConfig | None
    data: DataConfig | None
    alignment: AlignmentConfig | None
    reward_model: RewardModelConfig | None
    rl: RLConfig | None
    lora: LoraConfig | None
    restore_from: str | None
    optim: OptimConfig | None
    precision: str | None
    checkpoint: CheckpointConfig | None
    seed: int | None
    tensorboard: bool | None
    wandb: bool | None
    plot: bool | None
    wandb_kwargs: dict
    fault_tolerance: FaultToleranceConfig | None = None
    runtime: str | None = "nxdt"

    def sizing(self, model: Section) -> SizingConfig:
        """What parse_sizing reads, from this reading: the batch sizes as the data section read them (read again,
        quietly, where no data config was made, as for preference pairs)."""
        micro, global_ = ((self.data.micro_batch_size, self.data.global_batch_size) if self.data is not None
                          else read_batch(Section(model.data, "model", Report())))
        tokenizer = model.section("tokenizer").raw("model", None)  # as written, as parse_sizing reads it
        return SizingConfig(model=dict(model.data), tokenizer_path=str(tokenizer or ""), parallel=self.parallel,
                            micro_batch_size=micro, global_batch_size=global_,
                            precision=None if self.precision is None else PrecisionConfig(self.precision))

    def config(self, raw: Any) -> TrainingConfig:
        return TrainingConfig(
            run_name=str(self.run.raw("name", "run")), results_dir=Path(str(self.run.raw("results_dir"))),
            trainer=self.trainer, parallel=self.parallel, data=self.data, optim=self.optim,
            precision=PrecisionConfig(self.precision), model=ModelConfig.from_model_section(self.shape, self.vocab),
            tokenizer_path=self.tokenizer_path, tokenizer_vocab_size=self.vocab, seed=self.seed,
            tensorboard=self.tensorboard, wandb=self.wandb, wandb_kwargs=self.wandb_kwargs, plot=self.plot,
            checkpoint=self.checkpoint, elastic=self.elastic,
            raw=raw, restore_from_path=self.restore_from, sft=self.sft, lora=self.lora, alignment=self.alignment,
            reward_model=self.reward_model, rl=self.rl, fault_tolerance=self.fault_tolerance, runtime=self.runtime,
        )


def _read(root: Section, run: Section, trainer_s: Section, model_s: Section, exp: Section, precision_s: Section, *,
          p: str, files: Files, vocab_size: int | None) -> _Read:
    """Each section in turn, every value typed and checked on its own (the report lists problems in this order)."""
    report = root.report
    elastic = read_run(run, p, report)
    runtime = read_runtime(root, p)
    fault_tolerance = read_fault_tolerance(root.section("fault_tolerance"), report)
    trainer = read_trainer(trainer_s, p, report)
    shape, vocab, tokenizer_path = model_shape(model_s, p, report, files, vocab_size)
    parallel = read_parallel(model_s)
    packing_set = model_s.section("data").raw("packing", None)
    sft = read_sft_data(model_s, files, p, pairs=p.rstrip(".") in PAIR_STAGES, prompts=p.rstrip(".") == "rl")
    data = read_data(model_s, shape.get("encoder_seq_length"), files, p, sft_data=sft is not None)
    alignment, sft = read_stage_alignment(root, p, shape.get("encoder_seq_length"), sft, report)
    reward_model, sft = read_stage_reward(root, p, shape.get("encoder_seq_length"), sft, report)
    rl, sft = read_stage_rl(root, p, shape.get("encoder_seq_length"), sft, data, report)
    lora = read_peft(model_s, shape, p)
    restore_from = read_restore_from(model_s, shape, files, p)
    optim = read_optim(model_s, trainer.max_steps if trainer else None, p)
    precision = read_precision(precision_s)
    checkpoint = read_checkpoint(exp, run, p)
    seed = read_seed(model_s)
    tensorboard, wandb = exp.bool("create_tensorboard_logger", True), exp.bool("create_wandb_logger", False)
    plot = exp.bool("create_metrics_plot", True)
    wandb_kwargs = read_wandb_kwargs(exp, p, report)
    unknown_model_keys(model_s, shape, report)
    return _Read(run=run, elastic=elastic, trainer=trainer, shape=shape, vocab=vocab, tokenizer_path=tokenizer_path,
                 parallel=parallel, packing_set=packing_set, sft=sft, data=data, alignment=alignment,
                 reward_model=reward_model, rl=rl, lora=lora,
                 restore_from=restore_from, optim=optim, precision=precision, checkpoint=checkpoint, seed=seed,
                 tensorboard=tensorboard, wandb=wandb, plot=plot, wandb_kwargs=wandb_kwargs,
                 fault_tolerance=fault_tolerance, runtime=runtime)


def _rules(read: _Read, p: str, files: Files, report: Report) -> None:
    """The rules across sections, on well-typed values: the layout against the world (and under run.elastic against
    the world one node smaller), the batch and the model, the fine-tuning and alignment rules, the data's against
    the tokenizer, and the optimizer's."""
    layout_rules(report, p, read.trainer, read.parallel, read.data)
    shape_rules(report, p, read.shape, read.parallel, read.vocab)
    expert_rules(report, p, read.trainer, read.parallel, read.shape.get("moe"))
    context_rules(report, p, read.trainer, read.parallel, read.shape)
    if read.elastic:
        elastic_rules(report, p, read.trainer, read.parallel, read.data, read.shape)
    pairs = read.alignment or read.reward_model  # the preference files' reading (prompt limit, truncation)
    fine_tuning_rules(report, p, read.parallel, read.shape, read.sft if pairs is None else None, read.lora)
    if read.alignment is not None:
        alignment_rules(report, p, read.alignment, read.sft, read.parallel.context, read.packing_set,
                        read.lora is not None)
    if read.reward_model is not None:
        reward_rules(report, p, read.sft, read.parallel.context, read.packing_set)
    if read.rl is not None:
        rl_rules(report, p, read.rl, read.sft, read.trainer, read.parallel, read.packing_set, read.lora, files,
                 read.vocab)
    if pairs is not None:
        preference_file_rules(report, p, pairs, read.sft, files, read.tokenizer_path, read.shape)
    tokenizer_rules(report, p, read.sft, read.data, read.tokenizer_path, files)
    optim_rules(report, p, read.optim, read.parallel)
    report.error(rules.peer_state_interval(read.fault_tolerance, read.checkpoint, p))


def parse_model(model_raw: Any, *, files: str = "error", p: str = PREFIX) -> tuple[ModelConfig | None, Report]:
    """Only the model's shape from a training config's `model:` section (what conversion and evaluation rebuild
    from a checkpoint's recorded config); its layout keys are the training's and are not checked here."""
    report = Report()
    model = Section(model_raw, f"{p}model", report)
    shape, vocab, _ = model_shape(model, p, report, Files(report, files))
    if not report.errors:
        single = ParallelConfig(tp=1, pp=1, virtual_pp=None, sequence_parallel=False, zero1=False,
                                activation_checkpointing=None, recompute_modules=())
        shape_rules(report, p, shape, single, vocab)
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
    source, source_key = model_config_source(Section(model, f"{p}model", Report()))
    if source is None or (source_key == "restore_from_path" and (is_remote(source) or not Path(source).is_file())):
        return model  # the YAML's shape (weights not on this machine: what the YAML holds)
    report = Report()
    shape, vocab, _ = model_shape(Section(model, f"{p}model", report), p, report, Files(report, "error"))
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
    micro, global_ = read_batch(model)
    precision = read_precision(root.section("precision"))
    return SizingConfig(model=dict(model.data), tokenizer_path=str(tokenizer or ""), parallel=read_parallel(model),
                        micro_batch_size=micro, global_batch_size=global_,
                        precision=None if precision is None else PrecisionConfig(precision)), report


def parse_runtime(raw: Any, p: str = PREFIX) -> tuple[str | None, Report]:
    """Only <stage>.runtime of a trainer stage's config `raw` (the launcher builds the stage's job by it: which
    program runs); parse_training reads it the same way."""
    report = Report()
    return read_runtime(Section(raw, p.rstrip("."), report), p), report


def parse_precision(raw: Any, p: str = PREFIX) -> tuple[PrecisionConfig | None, Report]:
    """Only precision.type of a trainer stage's config `raw`, read without files (the Neuron job script's compiler
    flags, in a dry run too); parse_training reads it the same way."""
    report = Report()
    precision = read_precision(Section(raw, p.rstrip("."), report).section("precision"))
    return (None if precision is None else PrecisionConfig(precision)), report


def parse_fault_tolerance(raw: Any, p: str = PREFIX) -> tuple[FaultToleranceConfig | None, Report]:
    """Only <stage>.fault_tolerance of a trainer stage's config `raw`: what the launcher renders into the job script
    (the watchdog's timeouts, the restart loop); parse_training reads it the same way."""
    report = Report()
    return read_fault_tolerance(Section(raw, p.rstrip("."), report).section("fault_tolerance"), report), report


def parse_trainer(raw: Any, p: str = PREFIX) -> tuple[TrainerConfig | None, Report]:
    """Only the `trainer:` section of a trainer stage's config `raw`: what the launcher sizes the stage's job by
    (num_nodes x devices workers) and the estimator its run; parse_training reads it the same way."""
    report = Report()
    return read_trainer(Section(raw, p.rstrip("."), report).section("trainer"), p, report), report


def tokenizer_vocab(path: str, *, files: str = "error", p: str = PREFIX) -> tuple[int | None, Report]:
    """The tokenizer file's vocabulary and what its one rule (training_model.read_tokenizer_vocab) found, for a
    caller that needs only the vocabulary (autoconfig sizes its model by it before any training config exists):
    `files` as for parse_training."""
    report = Report()
    return read_tokenizer_vocab(path, p, Files(report, files)), report
