# Which model a compute budget can train, and the base config for it (NeMo AutoConfigurator's first two steps).
#
# Budget: nodes x devices x peak FLOP/s x assumed MFU x days. The 6·N·T rule (N parameters, T tokens) gives the
# parameter count the budget trains; the shape chosen is the largest of a fixed ladder whose full training cost
# T x (6·N + 12·L·h·s), attention included, fits the budget. The ladder is GPT-3's published shapes (or Llama's)
# above 100M parameters and small ones below, for trying the search on CPUs.
from __future__ import annotations

import dataclasses
import math
from typing import Any

from launcher.estimator.compute import SECONDS_PER_DAY, days_to_train, flops_per_token, six_n_t_parameters
from launcher.estimator.hardware import Hardware
from launcher.estimator.shapes import ModelShape, count_parameters
from runtime.schema.families import architecture as network


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None   # llama GQA; None = multi-head
    lr: float


def _gpt(layers: int, hidden: int, heads: int, lr: float) -> ShapeSpec:
    return ShapeSpec(layers, hidden, heads, 4 * hidden, None, lr)


def _llama(layers: int, hidden: int, heads: int, lr: float, ffn: int | None = None,
           groups: int | None = None) -> ShapeSpec:
    # SwiGLU's 8/3 x hidden, rounded up to a multiple of 64 (so tp up to 64 divides it); half as many KV heads.
    ffn = ffn or 64 * math.ceil(8 * hidden / 3 / 64)
    return ShapeSpec(layers, hidden, heads, ffn, groups or max(heads // 2, 1), lr)


# By the shape series an architecture's `sizes` names (runtime/schema/families' registry).
LADDERS: dict[str, list[ShapeSpec]] = {
    # GPT-3 (Brown et al. 2020, table 2.1; 5B, 20B and 40B as NeMo-Launcher) after six small trial shapes.
    "GPT-3": [_gpt(2, 64, 2, 3e-3), _gpt(4, 128, 4, 3e-3), _gpt(4, 256, 4, 2e-3), _gpt(6, 384, 6, 1.5e-3),
            _gpt(8, 512, 8, 1e-3), _gpt(10, 640, 10, 8e-4), _gpt(12, 768, 12, 6e-4), _gpt(24, 1024, 16, 3e-4),
            _gpt(24, 1536, 16, 2.5e-4), _gpt(24, 2048, 16, 2e-4), _gpt(32, 2560, 32, 1.6e-4),
            _gpt(24, 4096, 32, 1.6e-4), _gpt(32, 4096, 32, 1.2e-4), _gpt(40, 5120, 40, 1e-4), _gpt(44, 6144, 48, 1.4e-4),
            _gpt(48, 8192, 64, 1.1e-4), _gpt(96, 12288, 96, 0.9e-4)],
    # Llama 2 / 3 shapes after the same small trial shapes.
    "Llama 3": [_llama(2, 64, 2, 3e-3), _llama(4, 128, 4, 3e-3), _llama(4, 256, 4, 2e-3), _llama(6, 384, 6, 1.5e-3),
              _llama(8, 512, 8, 1e-3), _llama(12, 768, 12, 6e-4), _llama(16, 2048, 32, 3e-4, 8192, 8),
              _llama(28, 3072, 24, 3e-4, 8192, 8), _llama(32, 4096, 32, 3e-4, 14336, 8),
              _llama(40, 5120, 40, 3e-4, 13824, 40), _llama(80, 8192, 64, 1.5e-4, 28672, 8)],
}


def ladder_of(architecture: str) -> list[ShapeSpec]:
    """The model-size ladder of an architecture: the published shape series it follows."""
    return LADDERS[network(architecture).sizes]


def shape_of(spec: ShapeSpec, architecture: str, vocab: int, seq_length: int) -> ModelShape:
    return ModelShape(architecture, spec.num_layers, spec.hidden_size, spec.ffn_hidden_size,
                      spec.num_attention_heads, spec.num_query_groups or spec.num_attention_heads, vocab,
                      seq_length, seq_length, network(architecture).tied_default)


@dataclasses.dataclass(frozen=True)
class SizeRecommendation:
    budget_flops: float          # what the nodes deliver in `days` at the assumed MFU
    six_n_t_parameters: float    # N = budget / (6 T)
    spec: ShapeSpec
    parameters: int              # of the chosen shape
    days: float                  # its full training time at the assumed MFU
    fits_budget: bool            # False when even the smallest shape needs more than `days`


def recommend_model_size(*, architecture: str, vocab: int, seq_length: int, tokens: float, days: float,
                         devices: int, hardware: Hardware, mfu: float,
                         model_size: float | None = None) -> SizeRecommendation:
    """The largest ladder shape that trains `tokens` in `days` (or the one nearest `model_size` parameters)."""
    budget = devices * hardware.peak_tflops * 1e12 * mfu * days * SECONDS_PER_DAY
    ladder = [(spec, shape_of(spec, architecture, vocab, seq_length)) for spec in ladder_of(architecture)]
    if model_size:
        spec, shape = min(ladder, key=lambda item: abs(math.log(count_parameters(item[1]).total / model_size)))
    else:
        affordable = [(spec, shape) for spec, shape in ladder if flops_per_token(shape) * tokens <= budget]
        spec, shape = affordable[-1] if affordable else ladder[0]
    needed = days_to_train(shape, tokens, devices, hardware, mfu)
    return SizeRecommendation(budget, six_n_t_parameters(budget, tokens), spec, count_parameters(shape).total,
                              needed, needed <= days)


def base_settings(spec: ShapeSpec, *, architecture: str, seq_length: int, global_batch_size: int, tokens: float,
                  num_nodes: int, devices_per_node: int) -> dict[str, Any]:
    """The full-run training settings for a shape, as dotted keys under `training.`: the shape, the batch, the
    steps that consume `tokens`, and a cosine schedule with 1% warmup from the shape's learning rate."""
    steps = max(1, math.ceil(tokens / (global_batch_size * seq_length)))
    settings: dict[str, Any] = {
        "trainer.num_nodes": num_nodes,
        "trainer.devices": devices_per_node,
        "trainer.max_steps": steps,
        "model.architecture": architecture,
        "model.num_layers": spec.num_layers,
        "model.hidden_size": spec.hidden_size,
        "model.ffn_hidden_size": spec.ffn_hidden_size,
        "model.num_attention_heads": spec.num_attention_heads,
        "model.encoder_seq_length": seq_length,
        "model.global_batch_size": global_batch_size,
        "model.optim.lr": spec.lr,
        "model.optim.sched.name": "CosineAnnealing",
        "model.optim.sched.warmup_steps": math.ceil(steps / 100),
        "model.optim.sched.constant_steps": 0,
        "model.optim.sched.min_lr": spec.lr / 10,
    }
    if spec.num_query_groups is not None:  # grouped-query attention (the Llama series' shapes)
        settings["model.num_query_groups"] = spec.num_query_groups
    return settings
