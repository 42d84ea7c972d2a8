# The optimizer over the shards data parallelism hands it (runtime/parallel/data_parallel.py): per bucket, this
# rank's shard of weights (fp32: master copies, or the parameters themselves) and of reduced gradients. It keeps
# its library's per-element state (Adam's moments, SGD's momentum, schedule-free's z) for exactly that shard, so
# with ZeRO-1 it is sharded too; which library steps it is runtime/parallel/optimizers.py's business. It knows
# nothing of tensor, sequence or pipeline parallelism: clipping asks data parallelism for the global norm.
#
# It is memory-bound, so it makes few passes: torch's fused Adam/AdamW/SGD kernel where torch has it for the
# device (a single read-modify-write of weights, state and grads), the clip factor passed to that kernel rather
# than applied in a separate scaling pass.
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn

from runtime.parallel.data_parallel import data_parallel_of
from runtime.parallel.optimizers import AdafactorRule, ScheduleFreeRule, rule_for
from runtime.schema import rules


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def coerce(cls, cfg: Any) -> "AdamWConfig":
        """Accept this class, a mapping (the `model.optim` section) or any object with the same attributes."""
        if isinstance(cfg, cls):
            return cfg
        get = cfg.get if isinstance(cfg, Mapping) else lambda key, default: getattr(cfg, key, default)
        return cls(lr=float(get("lr", cls.lr)), weight_decay=float(get("weight_decay", cls.weight_decay)),
                   betas=tuple(float(b) for b in get("betas", cls.betas)), eps=float(get("eps", cls.eps)))


class ShardedOptimizer:
    """The optimizer model.optim.name chooses (runtime/parallel/optimizers.py: adamw, adam, sgd, adafactor,
    adamw_schedulefree, sgd_schedulefree), for a model that has data parallelism applied; no weight decay for
    biases and norm weights.

    optim_cfg: the `model.optim` section (an OptimConfig, a mapping, an AdamWConfig or any object with its
    attributes). Per bucket it keeps its library's per-element state for this rank's shard only (`state`, one
    {key: flat fp32 tensor} per bucket), so ZeRO-1 shards it; Adafactor's factored state is per whole
    parameter (`factored`), which is why it refuses ZeRO-1 (runtime/schema/rules_optim.py).
    """

    def __init__(self, model: nn.Module, optim_cfg: Any):
        self.data_parallel = data_parallel_of(model)
        self.cfg = AdamWConfig.coerce(optim_cfg)
        self.step_count = 0
        self._grad_scale: torch.Tensor | None = None  # what the next step divides the gradients by (clipping)
        self._pre_step_hooks: list = []
        buckets = self.data_parallel.buckets
        device = buckets[0].param_buffer.device
        self.rule = rule_for(optim_cfg, _fused_adamw_works(device))
        self.kind = self.rule.kind
        if problem := rules.optimizer_layout(self.kind.name, self.data_parallel.zero1, 1, 1, ""):
            raise ValueError(problem)  # the launch refuses it first (with tensor and expert parallelism too)
        size = lambda bucket: bucket.shard.stop - bucket.shard.start
        self.state = [{key: torch.zeros(size(b), dtype=torch.float32, device=device) for key in self.rule.state_keys}
                      for b in buckets]   # per bucket, {key: (shard,) fp32}
        self.groups = [self.rule.group_state() for _ in buckets]  # per bucket, the library's group scalars
        self.factored = ([[AdafactorRule.factored_state(seg.param.shape, device) for seg in b.segments]
                          for b in buckets] if not self.kind.elementwise else None)

    @property
    def exp_avg(self) -> list[torch.Tensor]:
        return [s["exp_avg"] for s in self.state]

    @property
    def exp_avg_sq(self) -> list[torch.Tensor]:
        return [s["exp_avg_sq"] for s in self.state]

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, a 0-d device tensor (nothing is read back). When it exceeds
        max_norm (None or <= 0: never), the next step() scales the gradients by max_norm / (norm + 1e-6), as
        torch.nn.utils.clip_grad_norm_ does: tensor arithmetic, so clipping or not is the same graph on XLA."""
        norm = self.data_parallel.grad_norm()
        self._grad_scale = (torch.where(norm > max_norm, (norm + 1e-6) / max_norm, torch.ones_like(norm))
                            if max_norm is not None and max_norm > 0 else None)
        return norm

    def _segment_states(self, i: int, bucket) -> list[dict]:
        if self.factored is not None:
            return self.factored[i]
        return [{key: flat[seg.in_shard] for key, flat in self.state[i].items()} for seg in bucket.segments]

    @torch.no_grad()
    def step(self, lr: float | None = None, add: dict[int, torch.Tensor] | None = None) -> None:
        """One step of the chosen optimizer on this rank's shards; data parallelism then writes the weights back.

        add: {id(parameter): a change of its values, flat}, added to its fp32 weights after the update, before
        they are written back (DeepSeek-V3's selection bias: runtime/step.py): so the master copy, the rounding
        and ZeRO-1's all-gather all carry one value on every rank."""
        lr = self.cfg.lr if lr is None else lr
        hooks, self._pre_step_hooks = self._pre_step_hooks, []
        for hook in hooks:  # e.g. an async checkpoint still copying the weights this update is about to change
            hook()
        self.train()  # schedule-free: back from the evaluation point a validation or a checkpoint moved to
        self.step_count += 1
        dp = self.data_parallel
        for i, bucket in enumerate(dp.buckets):
            weights = dp.shard_weights(bucket)
            if bucket.segments:  # not a ZeRO-1 shard made only of padding
                self.rule.step(self.step_count, weights, [seg.grad() for seg in bucket.segments],
                               self._segment_states(i, bucket), self.groups[i], lr,
                               self.cfg.weight_decay if bucket.decay else 0.0, self._grad_scale)
            for weight, seg in zip(weights, bucket.segments):
                if add and id(seg.param) in add:
                    weight.add_(add[id(seg.param)][seg.in_param])
            dp.write_back(bucket, weights)
        dp.finish_write_back()  # ZeRO-1: the all-gathers started bucket by bucket above
        self._grad_scale = None

    @torch.no_grad()
    def train(self) -> None:
        """Weights to the point training steps from (schedule-free's train(); a no-op for the others)."""
        self._switch(True)

    @torch.no_grad()
    def eval(self) -> None:
        """Weights to the point to evaluate and export (schedule-free's eval(): the averaged x; a no-op for the
        others). Validation and checkpoints call it; the next step() switches back (train())."""
        self._switch(False)

    def _switch(self, train: bool) -> None:
        if not isinstance(self.rule, ScheduleFreeRule) or all(g["train_mode"] == train for g in self.groups):
            return
        dp = self.data_parallel
        for i, bucket in enumerate(dp.buckets):
            weights = dp.shard_weights(bucket)
            if bucket.segments:
                self.rule.switch(weights, self._segment_states(i, bucket), self.groups[i], train)
            self.groups[i]["train_mode"] = train
            dp.write_back(bucket, weights)
        dp.finish_write_back()

    # ---- checkpointing hooks ----------------------------------------------------------------------------

    def add_pre_step_hook(self, hook) -> None:
        """Call `hook()` once, at the start of the next step(), before any weight or moment changes."""
        self._pre_step_hooks.append(hook)

    def scalars(self) -> dict:
        """What a checkpoint keeps besides the per-element state: the name, the library's group scalars, and
        Adafactor's factored state (per whole parameter, by this rank's bucket order: same layout only)."""
        out = {"name": self.kind.name, "groups": [dict(g) for g in self.groups]}
        if self.factored is not None:
            out["factored"] = [[{k: v for k, v in s.items() if k != "shape"} for s in b] for b in self.factored]
        return out

    def load_scalars(self, saved: dict | None) -> None:
        if not saved:  # a checkpoint written before optimizers were chosen: AdamW, no group scalars
            return
        if saved.get("name", self.kind.name) != self.kind.name:
            raise ValueError(f"model.optim.name: the checkpoint was saved with {saved['name']!r}, this run uses "
                             f"{self.kind.name!r}; resume with the same optimizer or set "
                             f"model.optim.name={saved['name']}")
        for group, g in zip(self.groups, saved.get("groups", [])):
            group.update(g)
        if self.factored is not None:
            factored = saved.get("factored")
            if factored is None or [len(b) for b in factored] != [len(b) for b in self.factored]:
                raise ValueError("model.optim.name: adafactor state was saved with another layout; resume it with "
                                 "the same tensor, pipeline and data parallel sizes")
            for mine, theirs in zip(self.factored, factored):
                for m, t in zip(mine, theirs):
                    for key, value in t.items():
                        m[key].copy_(value)

    def state_dict(self) -> dict:
        """This rank's optimizer state: per bucket its shard of state (and master weights), plus the step.

        Shards are laid out by data parallelism's buckets, which depend on the model and the layout: this reloads
        only into the same tp/dp/zero1 layout. Checkpoints use runtime/checkpoint instead, which reshards.
        """
        dp = self.data_parallel
        return {
            "step": self.step_count,
            "zero1": dp.zero1,
            "precision": dp.precision.name,
            "sr_generator": dp.sr_generator_state(),
            "scalars": self.scalars(),
            "buckets": [{**state, "master": b.master, "numel": b.param_buffer.numel()}
                        for b, state in zip(dp.buckets, self.state)],
        }

    def load_state_dict(self, state: dict) -> None:
        dp = self.data_parallel
        if len(state["buckets"]) != len(dp.buckets) or state["zero1"] != dp.zero1:
            raise ValueError("optimizer state was saved with a different bucket layout or zero1 setting")
        self.step_count = int(state["step"])
        dp.load_sr_generator_state(state["sr_generator"])
        self.load_scalars(state.get("scalars"))
        for bucket, mine, saved in zip(dp.buckets, self.state, state["buckets"]):
            if saved["numel"] != bucket.param_buffer.numel():
                raise ValueError("optimizer state was saved for a different model or parallel layout")
            for key, tensor in mine.items():
                tensor.copy_(saved[key])
            if bucket.master is not None and saved["master"] is not None:
                bucket.master.copy_(saved["master"])


# The name the runtime has always used; every optimizer is this class.
ShardedAdamW = ShardedOptimizer


def _fused_adamw_works(device: torch.device) -> bool:
    """Whether torch's single-pass AdamW kernel exists for this device (CPU and CUDA do; not every backend)."""
    try:
        t = [torch.zeros(2, device=device)]
        torch._fused_adamw_(t, [torch.ones(2, device=device)], [torch.zeros(2, device=device)],
                            [torch.zeros(2, device=device)], [], [torch.ones((), device=device)], lr=0.1, beta1=0.9,
                            beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        return True
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
