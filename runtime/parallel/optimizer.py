# AdamW over the shards data parallelism hands it (runtime/parallel/data_parallel.py): per bucket, this rank's
# shard of weights (fp32: master copies, or the parameters themselves) and of reduced gradients. The optimizer
# keeps the Adam moments for exactly that shard, so with ZeRO-1 they are sharded too. It knows nothing of
# tensor, sequence or pipeline parallelism: clipping asks data parallelism for the global norm.
#
# It is memory-bound, so it makes few passes: one fused AdamW kernel where torch has it for the device (a single
# read-modify-write of weights, moments and grads), the clip factor passed to that kernel rather than applied in
# a separate scaling pass.
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
from torch import nn

from runtime.parallel.data_parallel import data_parallel_of


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


class ShardedAdamW:
    """AdamW (decoupled weight decay, as torch.optim.AdamW, none for biases and norm weights) for a model that
    has data parallelism applied.

    optim_cfg: lr, weight_decay, betas, eps (an AdamWConfig, the `model.optim` mapping, or any object with those
    attributes).
    """

    def __init__(self, model: nn.Module, optim_cfg: Any):
        self.data_parallel = data_parallel_of(model)
        self.cfg = AdamWConfig.coerce(optim_cfg)
        self.step_count = 0
        self._grad_scale: torch.Tensor | None = None  # what the next step divides the gradients by (clipping)
        self._pre_step_hooks: list = []
        buckets = self.data_parallel.buckets
        device = buckets[0].param_buffer.device
        self._fused = _fused_adamw_works(device)
        zeros = lambda bucket: torch.zeros(bucket.shard.stop - bucket.shard.start, dtype=torch.float32,
                                           device=device)
        self.exp_avg = [zeros(b) for b in buckets]     # per bucket, (shard,) fp32
        self.exp_avg_sq = [zeros(b) for b in buckets]

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, a 0-d device tensor (nothing is read back). When it exceeds
        max_norm (None or <= 0: never), the next step() scales the gradients by max_norm / (norm + 1e-6), as
        torch.nn.utils.clip_grad_norm_ does: tensor arithmetic, so clipping or not is the same graph on XLA."""
        norm = self.data_parallel.grad_norm()
        self._grad_scale = (torch.where(norm > max_norm, (norm + 1e-6) / max_norm, torch.ones_like(norm))
                            if max_norm is not None and max_norm > 0 else None)
        return norm

    @torch.no_grad()
    def step(self, lr: float | None = None, add: dict[int, torch.Tensor] | None = None) -> None:
        """One AdamW step on this rank's shards; data parallelism then writes the weights back.

        add: {id(parameter): a change of its values, flat}, added to its fp32 weights after AdamW, before they
        are written back (DeepSeek-V3's selection bias: runtime/step.py): so the master copy, the rounding and
        ZeRO-1's all-gather all carry one value on every rank."""
        lr = self.cfg.lr if lr is None else lr
        hooks, self._pre_step_hooks = self._pre_step_hooks, []
        for hook in hooks:  # e.g. an async checkpoint still copying the weights this update is about to change
            hook()
        self.step_count += 1
        dp = self.data_parallel
        for bucket, exp_avg, exp_avg_sq in zip(dp.buckets, self.exp_avg, self.exp_avg_sq):
            weights = dp.shard_weights(bucket)
            if bucket.segments:  # not a ZeRO-1 shard made only of padding
                self._adamw(weights, [seg.grad() for seg in bucket.segments],
                            [exp_avg[seg.in_shard] for seg in bucket.segments],
                            [exp_avg_sq[seg.in_shard] for seg in bucket.segments],
                            lr, self.cfg.weight_decay if bucket.decay else 0.0)
            for weight, seg in zip(weights, bucket.segments):
                if add and id(seg.param) in add:
                    weight.add_(add[id(seg.param)][seg.in_param])
            dp.write_back(bucket, weights)
        dp.finish_write_back()  # ZeRO-1: the all-gathers started bucket by bucket above
        self._grad_scale = None

    def _adamw(self, weights, grads, exp_avgs, exp_avg_sqs, lr: float, weight_decay: float) -> None:
        beta1, beta2 = self.cfg.betas
        if self._fused:
            device = weights[0].device
            step = torch.tensor(float(self.step_count), device=device)
            # The kernel divides gradients by grad_scale: clipping costs no extra pass.
            torch._fused_adamw_(weights, grads, exp_avgs, exp_avg_sqs, [], [step] * len(weights), lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=self.cfg.eps,
                                amsgrad=False, maximize=False, grad_scale=self._grad_scale, found_inf=None)
            return
        # Reference formulation (torch.optim.AdamW's), for devices without the fused kernel.
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        for w, g, m, v in zip(weights, grads, exp_avgs, exp_avg_sqs):
            if self._grad_scale is not None:
                g = g / self._grad_scale
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(self.cfg.eps)
            if weight_decay:
                w.mul_(1 - lr * weight_decay)
            w.addcdiv_(m, denom, value=-lr / bias1)

    # ---- checkpointing hooks ----------------------------------------------------------------------------

    def add_pre_step_hook(self, hook) -> None:
        """Call `hook()` once, at the start of the next step(), before any weight or moment changes."""
        self._pre_step_hooks.append(hook)

    def state_dict(self) -> dict:
        """This rank's optimizer state: per bucket its shard of moments (and master weights), plus the step.

        Shards are laid out by data parallelism's buckets, which depend on the model and the layout: this reloads
        only into the same tp/dp/zero1 layout. Checkpoints use runtime/checkpoint instead, which reshards.
        """
        dp = self.data_parallel
        return {
            "step": self.step_count,
            "zero1": dp.zero1,
            "precision": dp.precision.name,
            "sr_generator": dp.sr_generator_state(),
            "buckets": [{"exp_avg": m, "exp_avg_sq": v, "master": b.master, "numel": b.param_buffer.numel()}
                        for b, m, v in zip(dp.buckets, self.exp_avg, self.exp_avg_sq)],
        }

    def load_state_dict(self, state: dict) -> None:
        dp = self.data_parallel
        if len(state["buckets"]) != len(dp.buckets) or state["zero1"] != dp.zero1:
            raise ValueError("optimizer state was saved with a different bucket layout or zero1 setting")
        self.step_count = int(state["step"])
        dp.load_sr_generator_state(state["sr_generator"])
        for bucket, m, v, saved in zip(dp.buckets, self.exp_avg, self.exp_avg_sq, state["buckets"]):
            if saved["numel"] != bucket.param_buffer.numel():
                raise ValueError("optimizer state was saved for a different model or parallel layout")
            m.copy_(saved["exp_avg"])
            v.copy_(saved["exp_avg_sq"])
            if bucket.master is not None and saved["master"] is not None:
                bucket.master.copy_(saved["master"])


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
