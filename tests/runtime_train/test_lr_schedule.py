# Learning-rate schedules: NeMo's warmup formula, the end points, the hold at min_lr, and bad keys.
import math

import pytest

from runtime.optim_schedule import LRSchedule


def test_cosine_matches_nemo():
    s = LRSchedule("CosineAnnealing", lr=1.0, max_steps=110, warmup_steps=10, min_lr=0.1)
    assert s(0) == pytest.approx(1 / 11)  # NeMo: (step + 1) / (warmup_steps + 1)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    values = [s(k) for k in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_hold():
    s = LRSchedule("LinearAnnealing", lr=2.0, max_steps=100, warmup_steps=0, constant_steps=20, min_lr=0.0)
    assert s(0) == pytest.approx(2.0)
    assert s(40) == pytest.approx(1.0)  # halfway through the 80 decay steps
    assert s(80) == 0.0 and s(99) == 0.0
    assert LRSchedule("WarmupAnnealing", 1.0, 10).name == "LinearAnnealing"


def test_constant_after_warmup():
    s = LRSchedule("Constant", lr=0.5, max_steps=10, warmup_steps=4)
    assert [round(s(k), 6) for k in (0, 3, 4, 9, 50)] == [0.1, 0.4, 0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "Cosine"}, "model.optim.sched.name: 'Cosine' is not one of CosineAnnealing"),
        ({"min_lr": 5.0}, "model.optim.sched.min_lr: 5.0 must be between 0 and model.optim.lr"),
        ({"warmup_steps": 11, "constant_steps": 5}, "warmup_steps 11 exceeds trainer.max_steps 10"),
        ({"warmup_steps": -1}, "model.optim.sched.warmup_steps: -1 must be an integer >= 0"),
    ],
)
def test_bad_schedules(kwargs, message):
    args = {"name": "CosineAnnealing", "lr": 1.0, "max_steps": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        LRSchedule(**args)
