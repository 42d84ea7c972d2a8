# What the fine_tuning and peft stages add to a freshly built model before parallelism: the starting weights
# (model.restore_from_path: a Hugging Face directory, imported on the fly through runtime/convert, or a checkpoint
# of ours, weights only) and LoRA adapters. One place, used by training, evaluation and conversion, so the three
# rebuild the same model from the same config.
#
# A LoRA run's checkpoints hold only what trains (the adapters and their optimizer state, see
# runtime/checkpoint/shards.py: data parallelism owns trainable parameters only), so every reader of such a
# checkpoint first rebuilds the base from restore_from_path, exactly as training did.
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runtime.models.lora import apply_lora
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import LoraConfig

KEY = "model.restore_from_path"


def is_hf_directory(path: str) -> bool:
    return not str(path).startswith("s3://") and (Path(path) / "config.json").is_file()


def read_pretrained(path: str, cfg: ModelConfig, key: str = KEY) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights at `path`, under our parameter names, checked against `cfg`'s shapes."""
    from runtime.convert.hf import load_hf_directory, state_shapes  # deferred: conversion pulls safetensors

    expected = state_shapes(cfg)
    if is_hf_directory(path):
        try:
            state, _, _ = load_hf_directory(path)
        except ValueError as error:
            raise ValueError(f"{key}: {path}: {error}") from None
        where = f"the Hugging Face model in {path}"
    else:
        from runtime.checkpoint import full_tensors, read_rank_files, resolve_checkpoint

        try:
            storage, checkpoint = resolve_checkpoint(path)
        except ValueError as error:
            raise ValueError(f"{key}: {error}; point it at a Hugging Face model directory or a checkpoint") \
                from None
        full = full_tensors(read_rank_files(storage, checkpoint))
        state = {name: full.get(name, "value") for name in expected if full.has(name, "value")}
        where = f"checkpoint {storage.root}/{checkpoint.name}"
    tied = cfg.share_embeddings_and_output_weights
    missing = [n for n in expected if n not in state and not (tied and n == "output.weight")]
    if missing:
        hint = " (a LoRA run saves its adapters only: export it merged, or restore from its own base)" \
            if any(".lora." in n for n in state) or not state else ""
        raise ValueError(f"{key}: {where} has no {missing[0]} ({len(missing)} weights missing): it is not a "
                         f"{cfg.architecture} model of this shape{hint}")
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{key}: {where} holds {name} with shape {tuple(state[name].shape)} but the model "
                             f"config makes {tuple(shape)}; set the model keys from its config (model.model_config"
                             f"=<dir>/config.json for a Hugging Face model) or choose weights of this model")
    return state


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, key: str = KEY) -> None:
    """Copy the weights at `path` into `model` (built by build_model, not yet parallelized), in place."""
    state = read_pretrained(path, model.cfg, key)
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
