"""The training loop's rules: the optimizer and its layout, the learning-rate schedule, and the trainer's and
checkpoints' counts (validation interval, data splits, save_top_k). Rules as runtime/schema/rules.py describes
them; callers use them as rules.<name>."""
from __future__ import annotations

import math


# ------------------------------------------------------------------------------------------- optimizer, schedule
def betas(value: object, p: str) -> str | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value):
        return None
    return f"{p}model.optim.betas: {value!r} is invalid; expected [beta1, beta2] each in [0, 1)"


def learning_rate(lr: float, p: str) -> str | None:
    if lr > 0:
        return None
    return f"{p}model.optim.lr: {lr!r} must be > 0"


def optimizer_options(name: str, momentum: float, dampening: float, nesterov: bool, p: str) -> str | None:
    """What torch.optim.SGD and schedulefree refuse, said at launch."""
    if name in ("sgd", "sgd_schedulefree") and momentum >= 1:
        return f"{p}model.optim.momentum: {momentum!r} must be below 1"
    if name == "sgd" and nesterov and (momentum <= 0 or dampening != 0):
        return (f"{p}model.optim.nesterov: Nesterov momentum needs model.optim.momentum > 0 and "
                f"model.optim.dampening 0 (momentum {momentum}, dampening {dampening})")
    return None


def optimizer_layout(name: str, zero1: bool, tp: int, ep: int, p: str) -> str | None:
    """Adafactor factors each weight's second moment into row and column statistics of the whole 2-D parameter
    (and scales its step by the parameter's RMS): a flat ZeRO-1 or ZeRO-2 shard (zero1 is true for either stage),
    or a tensor- or expert-parallel slice, would compute other statistics than one process does, so it runs on
    whole parameters only."""
    if name != "adafactor":
        return None
    split = [key for key, on in (("model.zero1 / model.zero_stage >= 1", zero1),
                                 ("model.tensor_model_parallel_size", tp > 1),
                                 ("model.expert_model_parallel_size", ep > 1)) if on]
    if not split:
        return None
    return (f"{p}model.optim.name: adafactor factors whole 2-D parameters, so it cannot run with "
            f"{' or '.join(split)}; turn {'them' if len(split) > 1 else 'it'} off or choose adamw, adam, sgd or "
            f"a schedule-free optimizer")


def min_lr(minimum: float, lr: float, schedule: str, p: str) -> str | None:
    if schedule == "Constant" or 0 <= minimum <= lr:
        return None
    return f"{p}model.optim.sched.min_lr: {minimum!r} must be between 0 and model.optim.lr {lr}"


def schedule_fits(warmup: int, constant: int, max_steps: int, p: str) -> str | None:
    """A warmup longer than the training never reaches the learning rate: refused."""
    if warmup <= max_steps:
        return None
    return (f"{p}model.optim.sched.warmup_steps: warmup_steps {warmup} exceeds trainer.max_steps {max_steps}; "
            f"shorten the warmup or train longer")


def schedule_holds(warmup: int, constant: int, max_steps: int, p: str) -> str | None:
    """constant_steps reaching past max_steps leaves no room to decay: NeMo's schedules then hold min_lr from the end
    of the warmup (their decay length, max_steps - warmup - constant, is negative), as runtime/optim_schedule.py does
    (NxD's megatron_gpt_config: 750 + 80000 over 20000 steps). Legal, and surely not what most users mean: a
    warning."""
    if warmup + constant <= max_steps or warmup > max_steps:
        return None
    return (f"{p}model.optim.sched.constant_steps: warmup_steps {warmup} + constant_steps {constant} exceeds "
            f"trainer.max_steps {max_steps}: as in NeMo, the learning rate holds min_lr from step {warmup + 1} to the "
            f"end, with no decay; lower constant_steps to {max_steps - warmup} or less to decay")


# ------------------------------------------------------------------------------------------ trainer, checkpoints
def val_check_whole(value: object, p: str) -> str | None:
    if not isinstance(value, float) or (math.isfinite(value) and value == int(value)):
        return None
    return (f"{p}trainer.val_check_interval: {value!r} must be a whole number of steps (fractions of an epoch are "
            f"not supported: training is step based)")


def splits(value: object, p: str) -> str | None:
    """train,valid,test weights as Megatron reads them: up to three non-negative numbers with a positive sum."""
    try:
        parts = [float(x) for x in str(value).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if parts and len(parts) <= 3 and all(math.isfinite(x) and x >= 0 for x in parts) and sum(parts) > 0:
        return None
    return (f"{p}model.data.splits_string: {value!r} is invalid; expected up to three non-negative weights for "
            f"train,valid,test such as '98,1,1'")


def save_top_k(value: int, p: str) -> str | None:
    if value == -1 or value > 0:
        return None
    return (f"{p}exp_manager.checkpoint_callback_params.save_top_k: {value} is invalid; use a positive count of "
            f"checkpoints to keep, or -1 to keep all")
