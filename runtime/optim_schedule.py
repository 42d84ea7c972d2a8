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

from runtime.schema import rules
from runtime.schema.choices import SCHEDULES


@dataclass(frozen=True)
class LRSchedule:
    name: str
    lr: float
    max_steps: int
    warmup_steps: int = 0
    constant_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self):
        # The schema's rules (the training config was checked with them already; this is for code that builds one).
        p = "training."
        problems = [SCHEDULES.problem(f"{p}model.optim.sched.name", self.name), rules.learning_rate(self.lr, p),
                    rules.min_lr(self.min_lr, self.lr, SCHEDULES.canonical(self.name), p),
                    rules.schedule_fits(self.warmup_steps, self.constant_steps, self.max_steps, p)]
        problems += [f"{p}model.optim.sched.{key}: {getattr(self, key)!r} must be an integer >= 0"
                     for key in ("warmup_steps", "constant_steps") if getattr(self, key) < 0]
        if any(problems):
            raise ValueError(next(problem for problem in problems if problem))
        object.__setattr__(self, "name", SCHEDULES.canonical(self.name))

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
