# The runtime's loader of the resolved training YAML the launcher wrote (Seam 2). Every key and rule lives in the
# schema (runtime/schema/training.py), which the launcher ran on the same config before submitting: here it runs
# again on the node, where the files are, so the job fails with the same lines the launcher would have printed.
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from runtime.schema.training import parse_model, parse_training
from runtime.schema.training_config import (CheckpointConfig, DataConfig, OptimConfig, ParallelConfig,
                                            PrecisionConfig, SchedConfig, TrainerConfig, TrainingConfig)
from runtime.schema.model import ModelConfig, tokenizer_vocab_size as _vocab_size

__all__ = ["CheckpointConfig", "DataConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "SchedConfig",
           "TrainerConfig", "TrainingConfig", "load_training_config", "parse_model_config", "parse_training_config",
           "tokenizer_vocab_size"]


def parse_training_config(raw: Any, stage: str = "training") -> TrainingConfig:
    """The typed config, or ConfigErrors (a ValueError) with one line per problem naming `<stage>.<key>`."""
    cfg, report = parse_training(raw, files="error", p=f"{stage}.")
    report.raise_if_any()
    assert cfg is not None
    return cfg


def load_training_config(path: str | os.PathLike, stage: str = "training") -> TrainingConfig:
    """Read and check the resolved training YAML the launcher wrote (Seam 1)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {str(path)!r} does not exist") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {str(path)!r} is not valid YAML: {str(error).splitlines()[0]}") from None
    return parse_training_config(raw, stage)


def parse_model_config(model_section: Any, tokenizer_path: str) -> ModelConfig:
    """Only the model's shape from a training config's `model:` section, with this tokenizer (conversion and
    evaluation rebuild the model a checkpoint recorded)."""
    model = {**dict(model_section or {}), "tokenizer": {"library": "huggingface", "model": tokenizer_path}}
    cfg, report = parse_model(model, files="error")
    report.raise_if_any()
    assert cfg is not None
    return cfg


def tokenizer_vocab_size(path: str) -> int:
    """Vocabulary size of a Hugging Face tokenizer.json, added tokens included."""
    try:
        return _vocab_size(path)
    except ValueError as error:
        raise ValueError(f"training.model.tokenizer.model: {error}") from None
