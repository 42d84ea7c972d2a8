# What the fine_tuning and peft stages add to a freshly built model before parallelism: the starting weights
# (model.restore_from_path: a Hugging Face directory or a checkpoint of ours, read by runtime/convert/pretrained.py)
# and LoRA adapters. One place, used by training, evaluation and conversion, so the three rebuild the same model
# from the same config.
#
# A LoRA run's checkpoints hold only what trains (the adapters and their optimizer state, see
# runtime/checkpoint/shards.py: data parallelism owns trainable parameters only), so every reader of such a
# checkpoint first rebuilds the base from restore_from_path, exactly as training did.
from __future__ import annotations

import torch
from torch import nn

from runtime.models.lora import apply_lora
from runtime.schema.training_config import LoraConfig


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str) -> None:
    """Copy the weights at `path` into `model` (built by build_model, not yet parallelized), in place."""
    from runtime.convert.pretrained import read_pretrained  # deferred: conversion pulls safetensors

    state = read_pretrained(path, model.cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in state.items():
        if name in params:
            params[name].copy_(tensor.to(params[name].dtype))


def prepare_for_fine_tuning(model: nn.Module, *, restore_from_path: str | None, lora: LoraConfig | None,
                            seed: int) -> nn.Module:
    """build_model's model -> with the starting weights loaded and, for LoRA, frozen with adapters added."""
    if restore_from_path:
        load_pretrained(model, restore_from_path)
    if lora is not None:
        apply_lora(model, lora, seed)
    return model


def prepare_from_config(model: nn.Module, training: dict) -> nn.Module:
    """The same from a checkpoint's saved config (evaluation, conversion): a LoRA run's base and adapters.
    Only a LoRA checkpoint needs the starting weights: a full fine-tuning checkpoint holds every weight."""
    from runtime.schema.reader import Report, Section
    from runtime.schema.training import parse_lora

    model_section = training.get("model") or {}
    lora = parse_lora(Section(model_section, "model", Report()), model_section.get("architecture"), "")
    if lora is None:
        return model
    return prepare_for_fine_tuning(model, restore_from_path=model_section.get("restore_from_path"), lora=lora,
                                   seed=int(model_section.get("seed", 1234)))
