# What the fine_tuning and peft stages add to the model: the starting weights (model.restore_from_path: a Hugging
# Face directory or a checkpoint of ours, read by runtime/convert/pretrained.py) and LoRA adapters. One place, used
# by training, evaluation and conversion, so the three rebuild the same model from the same config. Training adds
# the adapters to the meta model and loads each rank's own selection of the starting weights into its materialized
# shard (parallelize_model's starting_weights), and so does evaluation; conversion loads a built, unsharded model.
#
# A LoRA run's checkpoints hold only what trains (the adapters and their optimizer state, see
# runtime/checkpoint/shards.py: data parallelism owns trainable parameters only), so every reader of such a
# checkpoint first rebuilds the base from restore_from_path, exactly as training did.
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from runtime.device import flash_attention_kernels
from runtime.models.lora import apply_lora, is_adapter
from runtime.parallel import DataParallelConfig, parallelize_model
from runtime.parallel.plan import ShardingPlan
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import LoraConfig


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, plan: ShardingPlan | None = None, *, score_head: bool = False
                    ) -> None:
    """Copy the weights at `path` into `model`, in place: a built, unsharded model (plan None), or a rank's
    materialized shard of one (parallelize_model's starting_weights), each parameter from its own selection of
    the full tensor, one at a time (runtime/convert/pretrained.py read_selected). LoRA adapters keep their
    initial values. score_head: `model` is a reward model (runtime/alignment/reward.py), whose output.weight is its
    seeded score head, (1, hidden): the source's LM head (vocab, hidden), or its absence, is not looked at."""
    from runtime.convert.pretrained import read_selected  # deferred: conversion pulls safetensors

    plan = plan or ShardingPlan()
    cfg = model.cfg
    if score_head:  # read as a tied model, which has no head of its own to find or check
        cfg = dataclasses.replace(cfg, share_embeddings_and_output_weights=True)
    params, targets = {}, {}
    for local, param in model.named_parameters():  # each parameter once, under its first name
        full = plan.full_name(local)
        if is_adapter(full) or (score_head and full == "output.weight"):
            continue
        params[local] = param
        targets[local] = (full, plan.selection(local))  # a tied head: each source gives the embedding
    for local, tensor in read_selected(path, cfg, targets):
        params[local].copy_(tensor)


def prepare_for_fine_tuning(model: nn.Module, *, restore_from_path: str | None, lora: LoraConfig | None,
                            seed: int) -> nn.Module:
    """build_model's model -> with the starting weights loaded and, for LoRA, frozen with adapters added."""
    if restore_from_path:
        load_pretrained(model, restore_from_path)
    if lora is not None:
        apply_lora(model, lora, seed)
    return model


def fine_tuning_of(training: dict, cfg: ModelConfig | None = None) -> tuple[str | None, LoraConfig | None, int]:
    """(model.restore_from_path, LoRA, seed) from a checkpoint's saved training config; LoRA's targets as the model
    `cfg` (when given) names them."""
    from runtime.schema.training import saved_lora

    model_section = training.get("model") or {}
    lora, _ = saved_lora(model_section, cfg)
    return model_section.get("restore_from_path"), lora, int(model_section.get("seed", 1234))


def prepare_from_config(model: nn.Module, training: dict) -> nn.Module:
    """The same from a checkpoint's saved config (evaluation, conversion): a LoRA run's base and adapters.
    Only a LoRA checkpoint needs the starting weights: a full fine-tuning checkpoint holds every weight.
    A meta model gets its adapters only; its base comes from checkpoint_start's starting weights."""
    restore, lora, seed = fine_tuning_of(training, model.cfg)
    if lora is None:
        return model
    if next(model.parameters()).is_meta:
        return apply_lora(model, lora, seed)
    return prepare_for_fine_tuning(model, restore_from_path=restore, lora=lora, seed=seed)


def starting_weights(path: str | None, score_head: bool = False):
    """parallelize_model's starting_weights: each rank's part of the weights at `path` (None: none); score_head:
    a reward model's, whose head keeps its seeded values (load_pretrained)."""
    if not path:
        return None
    return lambda model, plan: load_pretrained(model, str(path), plan, score_head=score_head)


def checkpoint_start(training: dict):
    """What a checkpoint's model needs before the checkpoint is loaded into it, as parallelize_model's
    starting_weights: a LoRA run's base (its checkpoint holds the adapters only), else nothing."""
    restore, lora, _ = fine_tuning_of(training)
    return starting_weights(restore) if lora is not None else None


def parallelize_as_configured(cfg, model: nn.Module, topo, device, starting) -> nn.Module:
    """A trainer stage's model (cfg: its TrainingConfig), on the meta device, laid out as the config says and filled
    by `starting` (starting_weights' callable, or None): the trainer's model, and the rl stage's critic, the same way."""
    return parallelize_model(
        model,
        topo,
        sequence_parallel=cfg.parallel.sequence_parallel,
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        recompute_modules=cfg.parallel.recompute_modules,
        virtual_pp=cfg.parallel.virtual_pp,  # pp > 1: this rank's pipeline stage (runtime/parallel/pipeline)
        pipeline_cuts=cfg.parallel.pipeline_cuts,
        device=device.torch_device,
        data_parallel=DataParallelConfig(precision=cfg.precision.type, zero1=cfg.parallel.zero1, seed=cfg.seed,
                                         zero_stage=cfg.parallel.stage,
                                         overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                                         overlap_param_gather=cfg.parallel.overlap_param_gather),
        context=cfg.parallel.context_kind,
        attention_kernels=flash_attention_kernels,
        starting_weights=starting,
    )
