# LoRA (Hu et al., 2021): low-rank adapters beside the model's projections, applied to the plain model the way
# parallelism is (torchtitan style): meta_model -> apply_lora -> parallelize_model (which materializes the rank's
# part, adapters included, and loads its part of the pretrained weights); or build_model -> load -> apply_lora.
#
# The base weights keep their names and places (`layers.0.attn.qkv.weight`), are frozen (requires_grad False, so
# data parallelism gives them no gradient buffer and the optimizer no state) and stay bitwise what was loaded.
# Each adapted projection gets a `lora` child holding, per adapted target t, A_t (rank x in) and B_t (out_t x rank):
# `layers.0.attn.qkv.lora.A.q_proj`, `...lora.B.q_proj`. Our QKV and gate/up projections are fused, so one
# Linear carries up to three targets, each over its own segment of output rows; targets use the Hugging Face
# names, which is also how the PEFT export (runtime/convert/peft.py) names them. A network with an attention of its
# own says which projections it has (`lora_projections`: multi-head latent attention's, one target each).
#
#   y = x W^T + b + scale * concat_s [ B_s A_s dropout(x)  if s is adapted, else 0 ],  scale = alpha / rank
#
# Tensor parallelism (runtime/parallel/layers.py) shards the adapters with their base layer: B by output rows in a
# column-parallel layer, A by input columns in a row-parallel one; the other factor is replicated. Where tp exceeds
# the KV heads, a rank's B_k / B_v rows are its replicated head's, shared by that head's copies like the base.
from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models import SkipFillsOnMeta, materialize, network_class
from runtime.models.init import Init
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import LoraConfig


class LoRA(nn.Module):
    """The adapters of one projection. `segments`: (target name, rows) of the projection's output in order, as
    this rank holds it; only the names in A/B are adapted."""

    def __init__(self, segments: list[tuple[str, int]], A: dict[str, torch.Tensor], B: dict[str, torch.Tensor],
                 scale: float, dropout: float):
        super().__init__()
        self.segments, self.scale = list(segments), scale
        self.A = nn.ParameterDict({t: nn.Parameter(a) for t, a in A.items()})
        self.B = nn.ParameterDict({t: nn.Parameter(b) for t, b in B.items()})
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.placements: dict = {}  # set by tensor parallelism (ShardingPlan.collect reads it)
        self.enabled = True  # adapters_off: the base model alone (DPO's reference with LoRA)
        self.seed: int | None = None  # what A is drawn from (apply_lora's seed; None: the model's)

    def init_rules(self, prefix: str) -> dict[str, Init]:
        """A_t uniform in +-1/sqrt(in) (PEFT's kaiming-uniform with a = sqrt(5)), B_t zero; read unsharded."""
        rules = {f"{prefix}.A.{t}": Init("uniform", 1 / math.sqrt(a.shape[1]), seed=self.seed)
                 for t, a in self.A.items()}
        return rules | {f"{prefix}.B.{t}": Init("zeros") for t in self.B}

    def forward(self, x: torch.Tensor, y: torch.Tensor, B: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """y (..., out) the base projection's output for input x (..., in): y plus the adapters' deltas.
        B: factors to use in place of some of self.B's, as the layer hands them over (a replicated KV head's B,
        whose gradient the layer sums over the head's copies)."""
        if not self.enabled:
            return y
        x = self.dropout(x)
        B = {**self.B, **(B or {})}
        parts = y.split([rows for _, rows in self.segments], dim=-1) if len(self.segments) > 1 else (y,)
        out = []
        for (target, _), part in zip(self.segments, parts):
            if target in self.A:
                part = part + self.scale * F.linear(F.linear(x, self.A[target]), B[target])
            out.append(part)
        return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


class LoRALinear(nn.Linear):
    """An nn.Linear (same weight and bias Parameters, same names) with a `lora` child added to its output."""

    lora: LoRA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora(x, F.linear(x, self.weight, self.bias))


def _projections(cfg: ModelConfig) -> dict[str, tuple[list[tuple[str, int]], int]]:
    """Module path within a block -> (its output segments by Hugging Face name, its input size), unsharded. A
    network whose attention is its own (multi-head latent attention) names that attention's (`lora_projections`)."""
    own = getattr(network_class(cfg.architecture), "lora_projections", None)
    if own is not None:
        projections = {path: ([(name, rows)], columns) for path, (name, columns, rows) in own(cfg).items()}
    else:  # o_proj's input is not hidden_size when the head size is set apart (Qwen3)
        projections = {"attn.qkv": (list(cfg.fused_segments()["attn.qkv"]), cfg.hidden_size),
                       "attn.proj": ([("o_proj", cfg.hidden_size)], cfg.num_attention_heads * cfg.head_dim)}
    if cfg.moe is not None:
        return projections  # experts carry no adapters (a schema rule refuses MLP targets on MoE models)
    H, F = cfg.hidden_size, cfg.ffn_hidden_size
    if cfg.gated_mlp:
        projections["mlp.gate_up"] = (list(cfg.fused_segments()["mlp.gate_up"]), H)
        projections["mlp.down"] = ([("down_proj", H)], F)
    else:
        projections["mlp.fc1"] = ([("up_proj", F)], H)
        projections["mlp.fc2"] = ([("down_proj", H)], F)
    return projections


def projection_segments(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Module path within a block -> its output segments by Hugging Face name (the unsharded sizes)."""
    return {path: segments for path, (segments, _) in _projections(cfg).items()}


def projection_inputs(cfg: ModelConfig, path: str) -> int:
    """The input size of the projection at `path` (projection_segments' keys): the columns of its adapters' A."""
    return _projections(cfg)[path][1]


@torch.no_grad()
def apply_lora(model: nn.Module, lora: LoraConfig, seed: int) -> nn.Module:
    """Freeze every weight of `model` (an unsharded CausalLM: built, pretrained or not, or still on the meta
    device) and add adapters on `lora.target_modules`. A starts as PEFT's (kaiming-uniform, bound 1/sqrt(in)), B
    at zero, so the adapted model starts as the base model; their values are defined like every parameter's
    (LoRA.init_rules, runtime/models/init.py, from `seed`): the same adapters whatever the layout. On a meta model
    they stay on meta until the sharded model is materialized."""
    cfg: ModelConfig = model.cfg
    for param in model.parameters():
        param.requires_grad_(False)
    targets = set(lora.target_modules)
    for i, block in enumerate(model.layers):
        for path, segments in projection_segments(cfg).items():
            chosen = [(t, rows) for t, rows in segments if t in targets]
            if not chosen:
                continue
            parent_path, name = path.rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, name)
            meta = dict(device="meta", dtype=linear.weight.dtype)  # values: materialize, from init_rules
            A = {t: torch.empty(lora.rank, linear.in_features, **meta) for t, _ in chosen}
            B = {t: torch.empty(rows, lora.rank, **meta) for t, rows in chosen}
            with SkipFillsOnMeta():  # its own weight and bias are replaced by the base layer's just below
                adapted = LoRALinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                     device="meta")
            adapted.weight, adapted.bias = linear.weight, linear.bias
            adapted.lora = LoRA(segments, A, B, lora.scale, lora.dropout)
            adapted.lora.seed = seed
            setattr(parent, name, adapted)
    if not next(model.parameters()).is_meta:  # a built model: its adapters get their values now
        materialize(model, model.init_rules(), seed)
    return model


_ADAPTER = re.compile(r"^(?P<module>.+)\.lora\.(?P<factor>[AB])\.(?P<target>\w+)$")


def is_adapter(name: str) -> bool:
    return _ADAPTER.match(name) is not None


def adapter_names(name: str) -> tuple[str, str, str] | None:
    """`layers.0.attn.qkv.lora.A.q_proj` -> ('layers.0.attn.qkv', 'A', 'q_proj'); None for other parameters."""
    match = _ADAPTER.match(name)
    return None if match is None else (match["module"], match["factor"], match["target"])


@torch.no_grad()
def merge_lora(state: dict[str, torch.Tensor], cfg: ModelConfig, scale: float) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with adapters -> the base model's state dict with W_s += scale * B_s A_s
    folded into each adapted segment's rows (in fp32, then back to the weight's dtype). What a merged export
    writes: a plain model that computes what the adapted one does."""
    merged = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    segments = projection_segments(cfg)
    for name, A in state.items():
        parts = adapter_names(name)
        if parts is None or parts[1] != "A":
            continue
        module, _, target = parts
        local = module.split(".", 2)[2]  # layers.<i>.attn.qkv -> attn.qkv
        offset = 0
        for segment, rows in segments[local]:
            if segment == target:
                break
            offset += rows
        else:
            raise ValueError(f"{name}: no {target} segment in {module}")
        weight = merged[f"{module}.weight"].clone()
        B = state[f"{module}.lora.B.{target}"]
        delta = scale * (B.float() @ A.float())
        weight[offset:offset + B.shape[0]] = (weight[offset:offset + B.shape[0]].float() + delta).to(weight.dtype)
        merged[f"{module}.weight"] = weight
    return merged


def lora_modules(model: nn.Module) -> list[LoRA]:
    return [m for m in model.modules() if isinstance(m, LoRA)]


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Inside: the model computes its base projections alone, as before apply_lora (bitwise: the adapters'
    deltas are not added at all)."""
    modules = lora_modules(model)
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


__all__ = ["LoRA", "LoRALinear", "adapter_names", "adapters_off", "apply_lora", "is_adapter", "lora_modules",
           "merge_lora", "projection_inputs", "projection_segments"]
