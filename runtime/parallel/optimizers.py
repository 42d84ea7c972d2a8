# The optimizers model.optim.name chooses, each one a maintained implementation applied to the flat fp32 shards
# data parallelism hands the optimizer (runtime/parallel/optimizer.py): torch's functional Adam / AdamW / SGD /
# Adafactor (the very functions torch.optim's classes call from step()), and the `schedulefree` package's
# AdamWScheduleFree / SGDScheduleFree objects. None of the update math is written here: each rule below only
# lays this rank's state out (flat per bucket, so that ZeRO-1 shards it and checkpoints reshard it elementwise)
# and calls its library.
#
# What an optimizer owns, once, here: its library and the state tensors it keeps per element (the checkpoint's
# keys). Its names are runtime/schema/choices.py's OPTIMIZERS; its fp32 bytes of state per parameter are
# runtime/schema/facts.py's OPTIMIZER_STATE_BYTES (torch-free: the estimator reads them too).
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch.optim._adafactor import adafactor
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from runtime.schema.choices import OPTIMIZERS
from runtime.schema.facts import OPTIMIZER_STATE_BYTES


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
    name: str                     # model.optim.name, canonical (runtime/schema/choices.py OPTIMIZERS)
    library: str                  # where its step comes from (docs/runtime.md)
    state_keys: tuple[str, ...]   # per-element fp32 state, flat per bucket (sharded by ZeRO-1, resharded on resume)
    elementwise: bool = True      # False: its state is per parameter shape (Adafactor): no flat ZeRO-1 shard

    @property
    def state_bytes(self) -> int:
        """fp32 bytes of state per parameter: the estimator's figure (runtime/schema/facts.py)."""
        return OPTIMIZER_STATE_BYTES[self.name]


KINDS = {k.name: k for k in (
    OptimizerKind("adamw", "torch.optim.adam.adam (decoupled_weight_decay, as torch.optim.AdamW)",
                  ("exp_avg", "exp_avg_sq")),
    OptimizerKind("adam", "torch.optim.adam.adam (as torch.optim.Adam: L2 weight decay)", ("exp_avg", "exp_avg_sq")),
    OptimizerKind("sgd", "torch.optim.sgd.sgd (as torch.optim.SGD)", ("momentum_buffer",)),
    OptimizerKind("adafactor", "torch.optim._adafactor.adafactor (as torch.optim.Adafactor)", (), elementwise=False),
    OptimizerKind("adamw_schedulefree", "schedulefree.AdamWScheduleFree", ("z", "exp_avg_sq")),
    OptimizerKind("sgd_schedulefree", "schedulefree.SGDScheduleFree", ("z",)),
)}
# Every per-element state key any optimizer saves (runtime/checkpoint's tensor keys).
STATE_KEYS = tuple(dict.fromkeys(key for kind in KINDS.values() for key in kind.state_keys))


def _get(cfg: Any, key: str, default: Any) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)
    return default if value is None else value


class Rule:
    """One optimizer's step on one bucket's shard: weights and grads (flat fp32 views, one per segment: the
    grads are data parallelism's reduced main gradients, which a rule leaves as they are) and its state for them.
    grad_scale, when not None, divides the gradients first (clipping: runtime/parallel/optimizer.py)."""

    def __init__(self, cfg: Any, fused: bool):
        self.kind = KINDS[OPTIMIZERS.canonical(_get(cfg, "name", "adamw"))]
        self.lr = float(_get(cfg, "lr", 1e-3))
        self.weight_decay = float(_get(cfg, "weight_decay", 0.0))
        self.betas = tuple(float(b) for b in _get(cfg, "betas", (0.9, 0.999)))
        self.eps = float(_get(cfg, "eps", 1e-8))
        self.momentum = float(_get(cfg, "momentum", 0.0))
        self.dampening = float(_get(cfg, "dampening", 0.0))
        self.nesterov = bool(_get(cfg, "nesterov", False))
        self.fused = fused and self.kind.name in ("adam", "adamw", "sgd")

    @property
    def state_keys(self) -> tuple[str, ...]:
        return () if self.kind.name == "sgd" and not self.momentum else self.kind.state_keys

    def group_state(self) -> dict:
        """Per bucket scalars the library keeps per param group (schedule-free's k, lr_max, weight_sum)."""
        return {}

    def step(self, step: int, weights, grads, states: list[dict], group: dict, lr: float, weight_decay: float,
             grad_scale: torch.Tensor | None) -> None:
        raise NotImplementedError

    @staticmethod
    def scaled(grads, grad_scale):
        """The gradients divided by the clipping factor, for implementations without a grad_scale argument."""
        return grads if grad_scale is None else torch._foreach_div(grads, grad_scale)


class AdamRule(Rule):
    def step(self, step, weights, grads, states, group, lr, weight_decay, grad_scale):
        n = len(weights)
        device = weights[0].device
        # One step tensor per parameter, as torch.optim keeps them: the library increments each before use.
        steps = [torch.tensor(float(step - 1), device=device if self.fused else "cpu") for _ in range(n)]
        adam(weights, grads if self.fused else self.scaled(grads, grad_scale),
             [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], steps, foreach=False,
             fused=self.fused or None, grad_scale=grad_scale if self.fused else None,
             decoupled_weight_decay=self.kind.name == "adamw", amsgrad=False, beta1=self.betas[0],
             beta2=self.betas[1], lr=lr, weight_decay=weight_decay, eps=self.eps, maximize=False)


class SGDRule(Rule):
    def step(self, step, weights, grads, states, group, lr, weight_decay, grad_scale):
        keep = bool(self.momentum)
        # torch's SGD starts its momentum buffer from the first gradient (not from zeros): it is handed no
        # buffer until one exists, then this rank's flat state receives what it made.
        buffers = [s["momentum_buffer"] if keep and group.get("has_momentum") else None for s in states]
        sgd(weights, grads if self.fused else self.scaled(grads, grad_scale), buffers, foreach=False,
            fused=self.fused or None, grad_scale=grad_scale if self.fused else None, weight_decay=weight_decay,
            momentum=self.momentum, lr=lr, dampening=self.dampening, nesterov=self.nesterov, maximize=False)
        if keep:
            for s, buffer in zip(states, buffers):
                if buffer is not s["momentum_buffer"]:
                    s["momentum_buffer"].copy_(buffer)
            group["has_momentum"] = True


class AdafactorRule(Rule):
    """Whole parameters (its row and column statistics factor each 2-D weight): states hold row_var / col_var
    (or variance for vectors) shaped after the parameter."""

    def step(self, step, weights, grads, states, group, lr, weight_decay, grad_scale):
        grads = self.scaled(grads, grad_scale)
        shapes = [s["shape"] for s in states]
        steps = [torch.tensor(float(step - 1)) for _ in weights]
        adafactor([w.view(shape) for w, shape in zip(weights, shapes)],
                  [g.view(shape) for g, shape in zip(grads, shapes)],
                  [s.get("row_var") for s in states], [s.get("col_var") for s in states],
                  [s.get("variance") for s in states], steps, foreach=False, d=1.0, lr=lr, beta2_decay=-0.8,
                  weight_decay=weight_decay, eps1=None, eps2=1e-3, maximize=False)

    @staticmethod
    def factored_state(shape: torch.Size, device) -> dict:
        """torch.optim.Adafactor's state for a parameter of `shape`, zeros (its _init_group)."""
        if len(shape) > 1:
            row, col = list(shape), list(shape)
            row[-1], col[-2] = 1, 1
            return {"shape": shape, "row_var": torch.zeros(row, device=device),
                    "col_var": torch.zeros(col, device=device)}
        return {"shape": shape, "variance": torch.zeros(shape, device=device)}


class ScheduleFreeRule(Rule):
    """schedulefree's optimizer objects, stepped on this step's shard views: a fresh object per step whose
    params are the views, whose per-parameter state is this rank's flat state and whose group scalars are the
    bucket's (so the library's own step() runs, and nothing of it is duplicated here)."""

    def group_state(self) -> dict:
        return {"k": 0, "lr_max": -1.0, "weight_sum": 0.0, "train_mode": True}

    def _library(self, params, lr, weight_decay, group):
        import schedulefree  # the runtime extra's; imported only by the runs that choose it
        if self.kind.name == "adamw_schedulefree":
            opt = schedulefree.AdamWScheduleFree(params, lr=lr, betas=self.betas, eps=self.eps,
                                                 weight_decay=weight_decay, foreach=False)
        else:
            opt = schedulefree.SGDScheduleFree(params, lr=lr, momentum=self.momentum or 0.9,
                                               weight_decay=weight_decay, foreach=False)
        opt.param_groups[0].update(group)
        return opt

    def step(self, step, weights, grads, states, group, lr, weight_decay, grad_scale):
        grads = [g.clone() for g in grads] if grad_scale is None else self.scaled(grads, grad_scale)
        opt = self._library(weights, lr, weight_decay, group)
        for w, g, s in zip(weights, grads, states):
            w.grad = g
            if group["k"] == 0:  # the library's own start: z is a copy of the weights
                s["z"].copy_(w)
            opt.state[w] = {key: s[key] for key in self.state_keys}
        opt.step()
        for w in weights:
            w.grad = None
        group.update({key: opt.param_groups[0][key] for key in ("k", "lr_max", "weight_sum", "train_mode")})

    def switch(self, weights, states, group, train: bool) -> None:
        """schedulefree's train() / eval(): the weights move between the training point y and the averaged x."""
        opt = self._library(weights, self.lr, self.weight_decay, group)
        if group["k"]:  # before any step the library has no z: the weights are the same at both points
            for w, s in zip(weights, states):
                opt.state[w] = {key: s[key] for key in self.state_keys}
        opt.train() if train else opt.eval()
        group["train_mode"] = train


RULES: dict[str, Callable[..., Rule]] = {"adamw": AdamRule, "adam": AdamRule, "sgd": SGDRule,
                                         "adafactor": AdafactorRule, "adamw_schedulefree": ScheduleFreeRule,
                                         "sgd_schedulefree": ScheduleFreeRule}


def rule_for(cfg: Any, fused: bool) -> Rule:
    """The rule for model.optim `cfg` (its name, or an alias of it, as runtime/schema/choices.py lists them)."""
    name = _get(cfg, "name", "adamw")
    if problem := OPTIMIZERS.problem("model.optim.name", name):
        raise ValueError(problem)
    return RULES[OPTIMIZERS.canonical(name)](cfg, fused)
