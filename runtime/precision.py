# Training precision, by NxD Training's `precision.type` names. One policy object says what each name means;
# data parallelism (runtime/parallel/data_parallel.py) and train_step read it, nothing else branches on the name.
#
# | type              | params | master weights (fp32) | grad accumulation | param update rounding | forward      |
# | ----------------- | ------ | --------------------- | ----------------- | --------------------- | ------------ |
# | fp32              | fp32   | no (params are fp32)  | fp32              | -                     | fp32         |
# | bf16SR            | bf16   | no                    | fp32              | stochastic            | bf16         |
# | mixed_precision   | bf16   | yes                   | fp32              | round-to-nearest      | bf16         |
# | mixed_precisionSR | bf16   | yes                   | fp32              | stochastic            | bf16         |
# | autocast          | fp32   | no (params are fp32)  | fp32              | -                     | torch.autocast bf16 |
#
# Adam moments are fp32 in every mode. bf16SR keeps no fp32 copy of the weights: each update is computed in fp32
# from the bf16 weight and rounded back stochastically, which keeps small updates from vanishing on average.
# The table itself is runtime/schema/facts.py PRECISION_POLICIES (dtypes by name), which the estimator reads too.
from __future__ import annotations

import dataclasses

import torch

from runtime.schema import choices
from runtime.schema.facts import PRECISION_POLICIES

PRECISION_TYPES = tuple(choices.PRECISION_TYPES)


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype
    master_weights: bool        # a separate fp32 copy of the weights that the optimizer updates
    stochastic_rounding: bool   # fp32 -> bf16 weight writes round stochastically instead of to nearest
    autocast_dtype: torch.dtype | None  # forward runs under torch.autocast with this dtype

    @property
    def needs_rounding(self) -> bool:
        return self.param_dtype != torch.float32


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # facts.DTYPE_BYTES' names
_POLICIES = {
    name: Precision(name, _TORCH_DTYPES[policy.param], policy.master_weights, policy.stochastic_rounding,
                    _TORCH_DTYPES[policy.autocast] if policy.autocast else None)
    for name, policy in PRECISION_POLICIES.items()
}


def validate_precision(name: str) -> str:
    if problem := choices.PRECISION_TYPES.problem("training.precision.type", name):
        raise ValueError(problem)
    return name


def get_precision(precision: "str | Precision") -> Precision:
    if isinstance(precision, Precision):
        return precision
    return _POLICIES[validate_precision(precision)]


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 to bf16 up or down at random, with P(up) = distance to the lower neighbour / gap: E[round(x)] = x.

    bf16 is fp32 with the low 16 mantissa bits dropped. Adding uniform noise in [0, 2^16) to those bits before
    truncating carries into the kept bits with exactly that probability. Working on the magnitude bits makes it
    symmetric for negative numbers. NaN stays NaN (truncation could otherwise turn a NaN into inf).
    """
    assert x.dtype == torch.float32, x.dtype
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    rounded = (bits + noise).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32: clear the low 16 bits
    out = rounded.view(torch.float32).to(torch.bfloat16)  # exact: the dropped bits are already zero
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)
