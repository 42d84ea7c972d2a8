"""Precision policies and stochastic rounding: unbiased where round-to-nearest is not, and bf16SR still learns."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.models import build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, apply_data_parallel
from runtime.precision import PRECISION_TYPES, Precision, get_precision, stochastic_round_to_bf16, validate_precision
from runtime.step import train_step
from tests.runtime_parallel import harness as H

BF16_ULP_AT_ONE = 2.0 ** -7  # spacing of bf16 values in [1, 2)


def test_names_and_meanings():
    assert PRECISION_TYPES == ("fp32", "bf16SR", "mixed_precision", "mixed_precisionSR", "autocast")
    assert get_precision("bf16SR").param_dtype == torch.bfloat16
    assert not get_precision("bf16SR").master_weights and get_precision("bf16SR").stochastic_rounding
    assert get_precision("mixed_precision").master_weights and not get_precision("mixed_precision").stochastic_rounding
    assert get_precision("mixed_precisionSR").stochastic_rounding
    assert get_precision("autocast").autocast_dtype == torch.bfloat16
    assert get_precision("autocast").param_dtype == torch.float32
    with pytest.raises(ValueError, match="training.precision.type: 'bf16' is not one of fp32, bf16SR, "):
        validate_precision("bf16")


@pytest.mark.parametrize("value", [1.0 + 0.3 * BF16_ULP_AT_ONE, -(1.0 + 0.7 * BF16_ULP_AT_ONE), 3.3e-5])
def test_stochastic_rounding_is_unbiased_where_nearest_is_not(value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    rounded = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0))
    assert rounded.dtype == torch.bfloat16
    below, above = sorted({v.item() for v in rounded.float().unique()})  # always one of the two neighbours
    assert below < value < above
    gap = above - below
    sigma = gap * 0.5 / n ** 0.5  # std of the mean of n Bernoulli draws scaled by the gap (bounded by p = 1/2)
    assert abs(rounded.float().mean().item() - value) < 5 * sigma
    nearest_bias = abs(x.to(torch.bfloat16).float().mean().item() - value)
    assert nearest_bias > 0.15 * gap > 50 * sigma, "round-to-nearest is biased by a fixed fraction of the gap"


def test_stochastic_rounding_keeps_exact_values_and_specials():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.015625, float("inf"), float("-inf"), float("nan")])
    out = stochastic_round_to_bf16(x, torch.Generator().manual_seed(1)).float()
    torch.testing.assert_close(out, x, equal_nan=True)


def test_round_to_nearest_stalls_on_small_updates_where_stochastic_rounding_does_not():
    # Adam steps of 1e-5 on weights ~0.5 are a fraction of bf16's spacing there (2^-9 ~ 2e-3): rounding to
    # nearest throws every update away, stochastic rounding keeps them on average.
    rne = Precision("bf16-nearest", torch.bfloat16, False, False, None)
    drift = {}
    for name, policy in [("sr", get_precision("bf16SR")), ("rne", rne)]:
        layer = nn.Linear(64, 64, bias=False)
        nn.init.constant_(layer.weight, 0.5)
        apply_data_parallel(layer, Topology.build(ParallelDims(1, 1, 1, 1)), DataParallelConfig(policy))
        opt = ShardedAdamW(layer, {"lr": 1e-5})
        for _ in range(100):
            layer.data_parallel.zero_grad()
            layer.data_parallel.main_grad(layer.weight).fill_(1.0)  # constant gradient: Adam steps by -lr every time
            opt.step()
        drift[name] = (0.5 - layer.weight.float()).mean().item()
    assert drift["rne"] == 0.0
    assert drift["sr"] == pytest.approx(100 * 1e-5, rel=0.1)


@pytest.mark.parametrize("precision", ["bf16SR", "mixed_precisionSR", "autocast"])
def test_tiny_model_learns_in_reduced_precision(precision):
    torch.manual_seed(0)
    topo = Topology.build(ParallelDims(1, 1, 1, 1))
    model = build_model(H.tiny_config("llama"))
    optimizer = ShardedAdamW(apply_data_parallel(model, topo, DataParallelConfig(precision)), {**H.OPTIM, "lr": 3e-3})
    expected_dtype = torch.float32 if precision == "autocast" else torch.bfloat16
    assert all(p.dtype == expected_dtype for p in model.parameters())
    batch = [H.global_batch(128, step=0)]  # the same batch every step: a memorization task
    losses = [train_step(model, optimizer, batch, topo, lr=3e-3, clip=1.0).loss for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses
