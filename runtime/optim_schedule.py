# Learning-rate schedules as pure functions of the step, with NeMo's meaning of the keys.
#
# Step k (0-based) is the k-th optimizer update; lr(k) is the rate used for it. As in NeMo's
# WarmupAnnealHoldPolicy:
#   warmup   k <= warmup_steps:             lr * (k + 1) / (warmup_steps + 1)
#   decay    up to max_steps - constant_steps: from lr to min_lr (cosine or linear, by name)
#   hold     the last constant_steps steps, and anything past max_steps: min_lr
# With constant_steps = 0 this matches NeMo's CosineAnnealing / WarmupAnnealing step for step.
# A pure function is easy to test and to resume: nothing to checkpoint but the step.
from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULE_NAMES = ("CosineAnnealing", "LinearAnnealing", "Constant")
# Names other configs use for the same schedules (NeMo's WarmupAnnealing is the linear one).
_ALIASES = {"WarmupAnnealing": "LinearAnnealing", "LinearAnnealingWithWarmUp": "LinearAnnealing"}


@dataclass(frozen=True)
class LRSchedule:
    name: str
    lr: float
    max_steps: int
    warmup_steps: int = 0
    constant_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self):
        canonical = _ALIASES.get(self.name, self.name)
        if canonical not in SCHEDULE_NAMES:
            valid = ", ".join(SCHEDULE_NAMES + tuple(_ALIASES))
            raise ValueError(f"model.optim.sched.name {self.name!r} is unknown; valid: {valid}")
        object.__setattr__(self, "name", canonical)
        for key in ("warmup_steps", "constant_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.optim.sched.{key} {getattr(self, key)!r} must be >= 0")
        if self.lr <= 0:
            raise ValueError(f"model.optim.lr {self.lr!r} must be > 0")
        if self.name != "Constant":
            if not 0 <= self.min_lr <= self.lr:
                raise ValueError(
                    f"model.optim.sched.min_lr {self.min_lr!r} must be between 0 and model.optim.lr {self.lr}"
                )
            if self.warmup_steps + self.constant_steps > self.max_steps:
                raise ValueError(
                    f"model.optim.sched.warmup_steps {self.warmup_steps} + constant_steps {self.constant_steps} "
                    f"exceeds trainer.max_steps {self.max_steps}"
                )

    @property
    def decay_steps(self) -> int:
        return self.max_steps - self.warmup_steps - self.constant_steps

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.name == "Constant":
            return self.lr
        if step >= self.warmup_steps + self.decay_steps or self.decay_steps == 0:
            return self.min_lr
        progress = (step - self.warmup_steps) / self.decay_steps  # in [0, 1)
        if self.name == "CosineAnnealing":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            factor = 1.0 - progress
        return self.min_lr + (self.lr - self.min_lr) * factor
