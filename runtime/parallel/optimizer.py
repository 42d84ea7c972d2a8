# AdamW over flat buckets with data-parallel gradient reduction, optional ZeRO-1, global grad-norm clipping and
# the precision policies of runtime/precision.py. Megatron's distributed optimizer, reduced to its essentials.
#
# Parameters are re-homed into flat per-bucket buffers (params become views). Each bucket's optimizer state
# (Adam moments, fp32 master weights) covers one contiguous shard of it: the whole bucket without ZeRO-1, its
# 1/dp slice with ZeRO-1 (reduce-scatter grads, update the shard, all-gather params). The shard is cut into
# segments, one per parameter it overlaps, so the update runs on per-parameter views of flat storage.
#
# Gradients land in `param.main_grad`, fp32 whatever the parameter dtype, via a post-accumulate hook: copied
# into a flat grad buffer when a collective needs one (dp > 1) or a dtype change does (bf16 params), otherwise
# the fp32 gradient autograd produced is kept as is (no copy). Later micro-batches add to it.
#
# Embedding lookups are switched to sparse gradients (`module.sparse = True`): the optimizer adds the looked-up
# rows straight into main_grad instead of autograd zero-filling a vocab x hidden tensor and scattering into it.
# A tied embedding additionally gets its own alias Parameter over the same storage, so autograd no longer sums
# the two uses itself (a full vocab x hidden copy: the output layer's gradient is a view it will not modify in
# place); each use's hook accumulates into the one main_grad instead.
#
# The optimizer is memory-bound, so it makes few passes: one fused AdamW kernel where torch has it for the
# device (a single read-modify-write of weights, moments and grads), the clip factor passed to that kernel rather
# than applied in a separate scaling pass, and no zero-fill before the first micro-batch.
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
from torch import nn

from runtime.parallel import collectives as C
from runtime.parallel.topology import Topology
from runtime.precision import Precision, get_precision, stochastic_round_to_bf16

DEFAULT_BUCKET_NUMEL = 40_000_000  # ~160 MB of fp32 grads: few collectives, but not one huge blocking one


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


@dataclasses.dataclass
class _Segment:
    """The part of one parameter inside this rank's shard of a bucket."""

    param: nn.Parameter
    in_param: slice      # range in param.view(-1)
    in_shard: slice      # the same elements' range in the bucket's shard tensors
    norm_weight: float   # 1 / (number of ranks holding an identical copy of this gradient)

    def grad(self) -> torch.Tensor:
        return self.param.main_grad.view(-1)[self.in_param]


@dataclasses.dataclass
class _Bucket:
    params: list[nn.Parameter]
    weight_decay: float
    param_buffer: torch.Tensor        # (padded,) param dtype; the params are views into it
    grad_buffer: torch.Tensor | None  # (padded,) fp32 when gradients must be flat; main_grads are views into it
    shard: slice                      # the part of the buffers this rank updates
    master: torch.Tensor | None       # (shard,) fp32 master weights; None when the params are themselves fp32
    exp_avg: torch.Tensor             # (shard,) fp32
    exp_avg_sq: torch.Tensor
    segments: list[_Segment]


def _generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A private generator for stochastic rounding. XLA devices have none: they draw from the device's own RNG,
    which runtime.device seeds identically on every rank, so replicas still see the same noise."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return None


class DistributedOptimizer:
    """AdamW for a (parallelized) model. Build exactly one per model, after parallelize_model and the move to
    the device: it takes over the model's parameters.

    optim_cfg: lr, weight_decay, betas, eps (an AdamWConfig, the `model.optim` mapping, or any object with those
    attributes). precision: a runtime.precision name. zero1: shard moments and master weights over DP.
    seed: seeds the stochastic-rounding noise (the same on every rank).

    What it does to the model: parameters become views into flat buffers of the precision's dtype (bf16 casts
    happen here, after the fp32 master copy is taken); embedding lookups switch to sparse gradients; a tied
    embedding weight gets an alias Parameter over the same storage (so model.parameters() lists it twice);
    gradients arrive in `param.main_grad`, never `param.grad`.
    """

    def __init__(self, model: nn.Module, topo: Topology, optim_cfg: Any, precision: "str | Precision" = "fp32",
                 zero1: bool = False, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL, seed: int = 0):
        self.topo, self.cfg = topo, AdamWConfig.coerce(optim_cfg)
        self.precision, self.zero1 = get_precision(precision), bool(zero1)
        self.step_count = 0
        self._clip_coef = 1.0
        self._pre_step_hooks: list = []
        aliases = _split_tied_lookups(model, sparse=_sparse_grads_work(next(model.parameters()).device))
        self._params = [p for p in model.parameters() if p.requires_grad and not hasattr(p, "grad_owner")]
        if not self._params:
            raise ValueError("the model has no trainable parameters")
        device = self._params[0].device
        # Stochastic rounding noise: the same seed on every rank, so ranks holding identical replicas of a weight
        # (TP-replicated norms, or all DP ranks without ZeRO-1) draw identical noise and stay identical.
        self._sr_generator = _generator(device, seed) if self.precision.stochastic_rounding else None
        self._flat_grads = topo.dp.size > 1 or self.precision.param_dtype != torch.float32
        self._fused = _fused_adamw_works(device)
        self._sp_params = [p for p in self._params if getattr(p, "sequence_parallel", False)]
        # A tied embedding split by the pipeline: one copy on the first stage, one on the last (stages.py).
        self._pipeline_tied = [p for p in self._params if getattr(p, "pipeline_tied", False)]
        # Megatron's groups: no weight decay for biases and norm weights (every 1-D parameter).
        decay = [p for p in self._params if p.dim() > 1]
        no_decay = [p for p in self._params if p.dim() <= 1]
        self.buckets: list[_Bucket] = []
        for group, wd in ((decay, self.cfg.weight_decay), (no_decay, 0.0)):
            # Reverse order approximates the order gradients become ready in backward.
            for chunk in _split(list(reversed(group)), bucket_numel):
                self.buckets.append(self._make_bucket(chunk, wd))
        for p in self._params:
            p.main_grad_written = False
        for p in self._params + aliases:
            p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
        for alias in aliases:
            alias.data = alias.grad_owner.data  # follow the owner into its flat buffer

    def _make_bucket(self, params: list[nn.Parameter], weight_decay: float) -> _Bucket:
        dp, device = self.topo.dp, params[0].device
        numel = sum(p.numel() for p in params)
        padded = math.ceil(numel / dp.size) * dp.size if self.zero1 else numel
        shard_size = padded // dp.size if self.zero1 else padded
        start = dp.rank * shard_size if self.zero1 else 0
        shard = slice(start, start + shard_size)
        # Identical copies of a gradient across the world: TP replicas, and DP replicas unless each DP rank
        # updates a disjoint shard (ZeRO-1). The global norm sums squares / copies over every rank.
        dp_copies = 1 if self.zero1 else dp.size

        fp32 = torch.zeros(padded, dtype=torch.float32, device=device)
        segments, offset = [], 0
        for p in params:
            n = p.numel()
            fp32[offset:offset + n].copy_(p.detach().reshape(-1))
            lo, hi = max(offset, shard.start), min(offset + n, shard.stop)
            if lo < hi:
                copies = getattr(p, "tp_duplicates", self.topo.tp.size) * dp_copies
                if getattr(p, "pipeline_tied", False):
                    copies *= 2  # the same summed gradient sits on the first and the last stage
                segments.append(_Segment(p, slice(lo - offset, hi - offset), slice(lo - shard.start, hi - shard.start),
                                         1.0 / copies))
            offset += n

        # The master copy comes from the fp32 weights before they are cast, so init precision is not lost.
        master = fp32[shard].clone() if self.precision.master_weights else None
        param_buffer = fp32 if self.precision.param_dtype == torch.float32 else fp32.to(self.precision.param_dtype)
        grad_buffer = torch.zeros(padded, dtype=torch.float32, device=device) if self._flat_grads else None
        offset = 0
        for p in params:
            n = p.numel()
            p.data = param_buffer[offset:offset + n].view(p.shape)  # the module keeps the same Parameter object
            p.main_grad_buffer = grad_buffer[offset:offset + n].view(p.shape) if grad_buffer is not None else None
            p.main_grad = p.main_grad_buffer
            p.grad = None
            offset += n
        zeros = lambda: torch.zeros(shard_size, dtype=torch.float32, device=device)
        return _Bucket(params, weight_decay, param_buffer, grad_buffer, shard, master, zeros(), zeros(), segments)

    # ---- the phases train_step calls, in order -----------------------------------------------------------

    def zero_grad(self) -> None:
        """Start a new accumulation: the next backward overwrites each main_grad instead of adding to it."""
        for p in self._params:
            p.main_grad_written = False
        self._clip_coef = 1.0

    def reduce_gradients(self) -> None:
        """Finish the gradients: zeros for parameters no backward reached, sequence-parallel grads summed over
        TP, a pipeline-split tied embedding's grads summed over its first and last stage, then the sum over DP
        (per bucket)."""
        for p in self._params:
            if not p.main_grad_written:
                p.main_grad = p.main_grad_buffer if p.main_grad_buffer is not None else torch.empty(
                    p.shape, dtype=torch.float32, device=p.device)
                p.main_grad.zero_()
                p.main_grad_written = True
        if self._sp_params and self.topo.tp.size > 1:
            flat = torch.cat([p.main_grad.reshape(-1) for p in self._sp_params])
            C.all_reduce(flat, self.topo.tp)
            offset = 0
            for p in self._sp_params:
                p.main_grad.copy_(flat[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
        if self._pipeline_tied and self.topo.embedding is not None:
            # Both pipeline copies of a tied embedding take the sum of their gradients, so they stay equal.
            for p in self._pipeline_tied:
                C.all_reduce(p.main_grad, self.topo.embedding)
        dp = self.topo.dp
        if dp.size == 1:
            return
        for bucket in self.buckets:
            # Sum, not average: train_step already divides each rank's loss by the global token count.
            if self.zero1:
                shard = torch.empty_like(bucket.grad_buffer[bucket.shard])
                C.reduce_scatter_flat(shard, bucket.grad_buffer, dp)
                bucket.grad_buffer[bucket.shard].copy_(shard)
            else:
                C.all_reduce(bucket.grad_buffer, dp)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Global L2 norm of the reduced gradients over every rank (each distinct value counted once). When it
        exceeds max_norm (None or <= 0: never), the next step() scales the gradients by max_norm / norm."""
        total = torch.zeros((), dtype=torch.float32, device=self._params[0].device)
        for bucket in self.buckets:
            for seg in bucket.segments:
                total += torch.linalg.vector_norm(seg.grad()).square() * seg.norm_weight  # no squared temporary
        C.all_reduce_world(total)  # every rank's distinct share
        norm = total.sqrt().item()
        self._clip_coef = max_norm / (norm + 1e-6) if max_norm is not None and 0 < max_norm < norm else 1.0
        return norm

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One AdamW step on this rank's shards (decoupled weight decay, as torch.optim.AdamW), then write the
        weights back: cast to the param dtype (rounding per the precision) and, under ZeRO-1, all-gather."""
        lr = self.cfg.lr if lr is None else lr
        hooks, self._pre_step_hooks = self._pre_step_hooks, []
        for hook in hooks:  # e.g. an async checkpoint still copying the weights this update is about to change
            hook()
        self.step_count += 1
        for bucket in self.buckets:
            if not bucket.segments:
                continue  # a ZeRO-1 shard made only of padding
            params = [bucket.param_buffer[bucket.shard][seg.in_shard] for seg in bucket.segments]
            if bucket.master is not None:
                weights = [bucket.master[seg.in_shard] for seg in bucket.segments]
            else:
                weights = [p if p.dtype == torch.float32 else p.float() for p in params]  # bf16SR: fp32 copies
            grads = [seg.grad() for seg in bucket.segments]
            exp_avgs = [bucket.exp_avg[seg.in_shard] for seg in bucket.segments]
            exp_avg_sqs = [bucket.exp_avg_sq[seg.in_shard] for seg in bucket.segments]
            self._adamw(weights, grads, exp_avgs, exp_avg_sqs, lr, bucket.weight_decay)
            if self.precision.needs_rounding:
                for param, weight in zip(params, weights):
                    param.copy_(self._round(weight))
            if self.zero1 and self.topo.dp.size > 1:
                C.all_gather_flat(bucket.param_buffer, bucket.param_buffer[bucket.shard].clone(), self.topo.dp)
        self._clip_coef = 1.0

    def _adamw(self, weights, grads, exp_avgs, exp_avg_sqs, lr: float, weight_decay: float) -> None:
        beta1, beta2 = self.cfg.betas
        if self._fused:
            device = weights[0].device
            step = torch.tensor(float(self.step_count), device=device)
            # The kernel divides gradients by grad_scale: clipping costs no extra pass.
            scale = torch.tensor(1.0 / self._clip_coef, device=device) if self._clip_coef != 1.0 else None
            torch._fused_adamw_(weights, grads, exp_avgs, exp_avg_sqs, [], [step] * len(weights), lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=self.cfg.eps,
                                amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
            return
        # Reference formulation (torch.optim.AdamW's), for devices without the fused kernel.
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        for w, g, m, v in zip(weights, grads, exp_avgs, exp_avg_sqs):
            if self._clip_coef != 1.0:
                g = g * self._clip_coef
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(self.cfg.eps)
            if weight_decay:
                w.mul_(1 - lr * weight_decay)
            w.addcdiv_(m, denom, value=-lr / bias1)

    def _round(self, weights: torch.Tensor) -> torch.Tensor:
        if self.precision.stochastic_rounding:
            return stochastic_round_to_bf16(weights, self._sr_generator)
        return weights.to(self.precision.param_dtype)

    # ---- checkpointing hooks ----------------------------------------------------------------------------

    def add_pre_step_hook(self, hook) -> None:
        """Call `hook()` once, at the start of the next step(), before any weight or moment changes."""
        self._pre_step_hooks.append(hook)

    def sr_generator_state(self) -> torch.Tensor | None:
        return self._sr_generator.get_state() if self._sr_generator is not None else None

    def load_sr_generator_state(self, state: torch.Tensor | None) -> None:
        if self._sr_generator is not None and state is not None:
            self._sr_generator.set_state(state)

    def state_dict(self) -> dict:
        """This rank's optimizer state: per bucket its shard of moments (and master weights), plus the step.

        Shards are laid out by the bucket plan, which depends on the model and the layout: this reloads only into
        the same tp/dp/zero1 layout. Checkpoints use runtime/checkpoint instead, which reshards.
        """
        return {
            "step": self.step_count,
            "zero1": self.zero1,
            "precision": self.precision.name,
            "sr_generator": self._sr_generator.get_state() if self._sr_generator is not None else None,
            "buckets": [{"exp_avg": b.exp_avg, "exp_avg_sq": b.exp_avg_sq, "master": b.master,
                         "numel": b.param_buffer.numel()} for b in self.buckets],
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["buckets"]) != len(self.buckets) or state["zero1"] != self.zero1:
            raise ValueError("optimizer state was saved with a different bucket layout or zero1 setting")
        self.step_count = int(state["step"])
        if self._sr_generator is not None and state["sr_generator"] is not None:
            self._sr_generator.set_state(state["sr_generator"])
        for bucket, saved in zip(self.buckets, state["buckets"]):
            if saved["numel"] != bucket.param_buffer.numel():
                raise ValueError("optimizer state was saved for a different model or parallel layout")
            bucket.exp_avg.copy_(saved["exp_avg"])
            bucket.exp_avg_sq.copy_(saved["exp_avg_sq"])
            if bucket.master is not None and saved["master"] is not None:
                bucket.master.copy_(saved["master"])


def _sparse_grads_work(device: torch.device) -> bool:
    """Whether the device has sparse tensors (CPU and CUDA do; XLA does not): a probe, not a device name check."""
    try:
        torch.sparse_coo_tensor(torch.zeros((1, 1), dtype=torch.long, device=device), torch.ones(1, device=device),
                                (1,)).coalesce()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _split_tied_lookups(model: nn.Module, *, sparse: bool) -> list[nn.Parameter]:
    """Turn on sparse gradients for embedding lookups where the device has them; give each tied one an alias
    Parameter (see the header)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    aliases = []
    for module in model.modules():
        if not isinstance(getattr(module, "sparse", None), bool):  # nn.Embedding, VocabParallelEmbedding
            continue
        module.sparse = sparse
        weight = module.weight
        if users[id(weight)] > 1 and weight.requires_grad:
            alias = nn.Parameter(weight.detach())  # same storage
            alias.__dict__.update({k: v for k, v in weight.__dict__.items() if not k.startswith("main_grad")})
            alias.grad_owner = weight
            module.weight = alias
            aliases.append(alias)
    return aliases


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    # Runs once per backward after autograd has summed this parameter's gradient, then drops .grad so the next
    # micro-batch starts from nothing (and bf16 gradients never accumulate in bf16). An alias accumulates into
    # its owner's main_grad.
    grad = param.grad
    param.grad = None
    owner = getattr(param, "grad_owner", param)
    if grad.is_sparse:  # embedding rows: add them into a dense fp32 buffer, kept across steps
        if not owner.main_grad_written:
            if owner.main_grad_buffer is None:
                owner.main_grad_buffer = torch.empty(owner.shape, dtype=torch.float32, device=owner.device)
            owner.main_grad = owner.main_grad_buffer.zero_()
        owner.main_grad.index_add_(0, grad._indices()[0], grad._values().to(torch.float32))
    elif owner.main_grad_written:
        owner.main_grad.add_(grad)
    elif owner.main_grad_buffer is not None:
        owner.main_grad = owner.main_grad_buffer.copy_(grad)
    else:
        owner.main_grad = grad  # already fp32 and no flat buffer needed: keep autograd's tensor
    owner.main_grad_written = True


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


def _split(params: list[nn.Parameter], max_numel: int) -> list[list[nn.Parameter]]:
    chunks, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > max_numel:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return chunks + [current] if current else chunks
