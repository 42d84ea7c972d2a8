# Data parallelism, the last step of parallelize_model: where parameters and their gradients live, and how
# gradients are finished (reduced) before the optimizer reads them. Megatron's distributed-optimizer buffers,
# reduced to their essentials; the optimizer itself (runtime/parallel/optimizer.py) only updates what this hands it.
#
# Parameters are re-homed into flat per-bucket buffers of the precision's dtype (params become views; bf16 casts
# happen here, after the fp32 master copy is taken). Each bucket has a shard this rank owns: the whole bucket, or
# with ZeRO-1 its 1/dp slice (gradients reduce-scattered, the shard updated, parameters all-gathered back). The
# shard is cut into segments, one per parameter it overlaps, so the update runs on per-parameter views.
#
# Gradients land in each parameter's main gradient, fp32 whatever the parameter dtype, via a post-accumulate hook:
# copied into a flat grad buffer when a collective needs one (dp > 1) or a dtype change does (bf16 params),
# otherwise the fp32 gradient autograd produced is kept as is (no copy). Later micro-batches add to it.
#
# Embedding lookups are switched to sparse gradients (`module.sparse = True`): the looked-up rows are added
# straight into the main gradient instead of autograd zero-filling a vocab x hidden tensor and scattering into it.
# A tied embedding additionally gets its own alias Parameter over the same storage, so autograd no longer sums
# the two uses itself (a full vocab x hidden copy: the output layer's gradient is a view it will not modify in
# place); each use's hook accumulates into the one main gradient instead.
#
# Overlap (Megatron's overlap_grad_reduce, DDP's default): with dp > 1 each bucket's reduction starts as soon as
# the last gradient of the step's last micro-batch lands in it, while backward goes on with earlier layers; the
# step waits on them only before the gradient norm. Readiness is counted, not guessed from a schedule: every
# parameter's hook fires once per backward (a tied embedding's twice, once through its alias), so a bucket is
# ready when it has seen uses x micro-batches hooks; a parameter that never takes part (an expert no token chose)
# simply leaves its bucket to the end-of-backward pass. Buckets start strictly in their index order whatever order
# they become ready in, so every rank issues the same collectives in the same order. Buckets holding a gradient
# that must first be summed over another group (sequence-parallel norms over TP, a pipeline-tied embedding over
# its two stages) are reduced after backward, as before. The reduction is the same collective on the same buffer
# either way, so overlap on and off are bitwise equal. With ZeRO-1 the parameter all-gather of each bucket starts
# when its update is written back and is waited on after the last bucket's update (overlap_param_gather).
#
# ZeRO-2 (zero_stage 2) is ZeRO-1 with the gradients kept sharded too: a bucket's full fp32 gradient buffer is
# allocated when its first gradient of the step lands, accumulates every micro-batch (Megatron's choice, so the
# sums are ZeRO-1's bit for bit), and is freed once its reduce-scatter has run (during the last backward with
# overlap); only the rank's (shard,) gradient stays, and the optimizer, the norm and clipping read that.
#
# ZeRO-3 (zero_stage 3) is ZeRO-2 with the parameters sharded too: runtime/parallel/zero3.py frees each bucket's
# parameter buffer between uses and gathers it per unit (a block), which is why buckets are cut at unit boundaries.
#
# Hybrid sharding (model.data_parallel_shard_degree N, torchtitan's HSDP): every ZeRO stage shards within the
# bucket's shard group (N consecutive dp or edp ranks, a node's when N is its devices: Topology.shard_axes) instead
# of the whole group; a gradient is reduce-scattered there, then the shard all-reduced over the replica group (the
# ranks holding the same shard), and parameters are all-gathered within the shard group only.
#
# What the reduction needs to know about each parameter (sequence-parallel partial gradients, pipeline-tied
# copies, how many ranks hold the same value for the global norm) comes from the model's ShardingPlan.
from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from runtime.parallel import collectives as C
from runtime.parallel.buckets import Bucket, MainGrad, Segment, accumulate
from runtime.parallel.plan import plan_of
from runtime.parallel.sparse_lookups import sparse_grads_work, split_tied_lookups
from runtime.parallel.topology import AxisGroup, Topology
from runtime.parallel.zero3 import Zero3, unit_index
from runtime.precision import Precision, get_precision, stochastic_round_to_bf16

DEFAULT_BUCKET_NUMEL = 40_000_000  # ~160 MB of fp32 grads: few collectives, but not one huge blocking one
GLOO_REDUCTIONS_IN_FLIGHT = 2      # ZeRO-1 on gloo: it copies each reduce-scatter's input while it runs
# ZeRO-2/3 on gloo: each reduction in flight also keeps its bucket's full gradient buffer, and the next bucket's
# backward still overlaps the one in flight (at 87M ZeRO-3 two in flight peaked 40 MiB higher: benchmarks/README.md)
GLOO_SHARDED_GRADS_IN_FLIGHT = 1


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    precision: "str | Precision" = "fp32"     # a runtime.precision name
    zero1: bool = False                        # shard master weights (and the optimizer's moments) over DP
    zero_stage: int | None = None              # 0, 1, 2 (also the gradients), 3 (and the parameters); None: zero1
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    seed: int = 0                              # stochastic-rounding noise, the same on every rank
    overlap_grad_reduce: bool = True           # start each bucket's reduction during backward (see the header)
    overlap_param_gather: bool = True          # ZeRO-1: all-gather bucket k while bucket k + 1 is updated


def _generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A private generator for stochastic rounding. XLA devices have none: they draw from the device's own RNG,
    which runtime.device seeds identically on every rank, so replicas still see the same noise."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return None


def apply_data_parallel(model: nn.Module, topo: Topology, config: DataParallelConfig = DataParallelConfig()
                        ) -> nn.Module:
    """Give `model` (parallelized and on its device) its DataParallel as `model.data_parallel`; returns it."""
    if getattr(model, "data_parallel", None) is not None:
        raise ValueError("data parallelism is already applied to this model")
    model.data_parallel = DataParallel(model, topo, config)
    return model


def data_parallel_of(model: nn.Module) -> "DataParallel":
    dp = getattr(model, "data_parallel", None)
    if dp is None:
        raise ValueError("the model has no data parallelism applied: call parallelize_model(..., "
                         "data_parallel=DataParallelConfig(...)) or apply_data_parallel(model, topo) first")
    return dp


class DataParallel:
    """The flat parameter and gradient buffers of one model, and the gradient reduction over DP (and over TP
    for sequence-parallel weights, over the first and last pipeline stage for a tied embedding)."""

    def __init__(self, model: nn.Module, topo: Topology, config: DataParallelConfig):
        self.topo, self.precision = topo, get_precision(config.precision)
        stage = int(bool(config.zero1)) if config.zero_stage is None else config.zero_stage
        if stage not in (0, 1, 2, 3) or (config.zero1 and stage == 0):
            raise ValueError(f"zero_stage {config.zero_stage!r} with zero1={config.zero1}: 0 to 3 (zero1 is 1)")
        self.zero_stage, self.zero1 = stage, stage >= 1  # zero1: the optimizer state is sharded
        self.overlap_param_gather, plan = bool(config.overlap_param_gather), plan_of(model)
        self._aliases = split_tied_lookups(model, sparse=sparse_grads_work(next(model.parameters()).device))
        # (name, parameter) for every parameter this owns, in model.parameters() order; aliases are skipped
        # (they share their owner's storage), so a tied embedding is owned under the name its owner has.
        self.named_params = [(name, p) for name, p in model.named_parameters()
                             if p.requires_grad and id(p) not in {id(alias) for alias, _ in self._aliases}]
        if not self.named_params:
            raise ValueError("the model has no trainable parameters")
        # Frozen weights (a LoRA model's base) get no buffers, gradients or optimizer state; they only take the
        # precision's parameter dtype, so the forward sees one dtype.
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and p.dtype != self.precision.param_dtype:
                p.data = p.data.to(self.precision.param_dtype)
        self.plan = plan
        self.params = [p for _, p in self.named_params]
        names = {id(p): name for name, p in self.named_params}
        device = self.params[0].device
        # Stochastic rounding noise: the same seed on every rank, so ranks holding identical replicas of a weight
        # (TP-replicated norms, or all DP ranks without ZeRO-1) draw identical noise and stay identical.
        self._sr_generator = _generator(device, config.seed) if self.precision.stochastic_rounding else None
        self._flat_grads = topo.dp.size > 1 or self.precision.param_dtype != torch.float32
        # ZeRO-1's collectives run in place where the backend allows (collectives.in_place_shard_ok): the
        # reduce-scatter into the rank's own slice of the buffer it reads, the all-gather from the rank's own slice
        # of the buffer it fills. No shard-sized copy per bucket while they are in flight (with overlap, every
        # bucket's at once: 1/dp of the model, twice).
        # Where a reduce-scatter copies its whole input while it runs (gloo), at most this many run at once (oldest
        # waited on first, in the order every rank starts them; ZeRO-2/3: one, see GLOO_SHARDED_GRADS_IN_FLIGHT).
        # Not under a pipeline: a rank waiting inside its backward could hold up the stage its peer's waits on.
        in_flight = GLOO_SHARDED_GRADS_IN_FLIGHT if stage >= 2 else GLOO_REDUCTIONS_IN_FLIGHT
        self._max_in_flight = in_flight if self.zero1 and topo.pp.size == 1 else None
        self.main_grads: dict[int, MainGrad] = {}
        self._partial = [p for p in self.params if plan[names[id(p)]].partial_grad]
        self._pipeline_tied = [p for p in self.params if plan[names[id(p)]].pipeline_tied]
        # Megatron's groups: no weight decay for biases and norm weights (every 1-D parameter). Experts sharded
        # by expert parallelism have buckets of their own: their replicas are the expert-data-parallel group.
        expert = {id(p) for p in self.params if plan[names[id(p)]].expert}
        dense = [p for p in self.params if id(p) not in expert]
        groups = ((topo.dp, [p for p in dense if p.dim() > 1], True),
                  (topo.dp, [p for p in dense if p.dim() <= 1], False),
                  (topo.edp, [p for p in self.params if id(p) in expert], True))
        # Reverse order approximates the order gradients become ready in backward, except for what an embedding
        # lookup reads (the input's, or a tied one's): those are ready only at the very end of backward, so they
        # go last and in buckets of their own, or they would hold the first layers' gradients back until then.
        lookups = {id(module.weight) for module in model.modules() if isinstance(getattr(module, "sparse", None), bool)}
        lookups |= {id(owner) for _, owner in self._aliases}
        self.buckets: list[Bucket] = []
        units = unit_index(model) if stage == 3 else {}  # ZeRO-3 gathers per unit: no bucket spans two
        for axis, group, decay in groups:
            ordered = list(reversed(group))
            layers = [p for p in ordered if id(p) not in lookups]
            for chunk in _split(layers, config.bucket_numel, units) + _split(
                    [p for p in ordered if id(p) in lookups], config.bucket_numel, units):
                self.buckets.append(self._make_bucket(chunk, decay, names, axis, *topo.shard_axes(axis)))
        bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        deferred = {id(p) for p in self._partial + self._pipeline_tied}
        for bucket in self.buckets:
            bucket.uses = len(bucket.params)
            bucket.deferred = any(id(p) in deferred for p in bucket.params)
        for p in self.params:
            p.register_post_accumulate_grad_hook(
                functools.partial(self._on_grad, self.main_grads[id(p)], bucket_of[id(p)]))
        for alias, owner in self._aliases:
            self.buckets[bucket_of[id(owner)]].uses += 1
            alias.register_post_accumulate_grad_hook(
                functools.partial(self._on_grad, self.main_grads[id(owner)], bucket_of[id(owner)]))
            alias.data = owner.data  # follow the owner into its flat buffer
        # The buckets that may start during backward, in the one order every rank starts them in.
        self._early = [i for i, b in enumerate(self.buckets)
                       if config.overlap_grad_reduce and b.axis.size > 1 and not b.deferred]
        self._remaining: list[int] | None = None  # per bucket, hooks still to come this step; None: no overlap
        self._started = 0                         # how many of self._early have started
        self._pending: list[tuple[Bucket, C.Pending, torch.Tensor | None]] = []  # started, not yet waited on
        self._gathers: list[C.Pending] = []
        self.zero3 = Zero3(model, self, self._aliases) if stage == 3 else None

    def _make_bucket(self, params: list[nn.Parameter], decay: bool, names: dict[int, str], dp: AxisGroup,
                     shard_axis: AxisGroup, replica_axis: AxisGroup) -> Bucket:
        device = params[0].device
        numel = sum(p.numel() for p in params)
        cut = shard_axis  # ZeRO's shards: over dp (edp), or hybrid's shard group
        if not self.zero1 and shard_axis.size < dp.size:
            raise ValueError("hybrid sharding (a shard degree below dp) needs zero_stage >= 1: stage 0 shards nothing")
        padded = math.ceil(numel / cut.size) * cut.size if self.zero1 else numel
        shard_size = padded // cut.size if self.zero1 else padded
        start = cut.rank * shard_size if self.zero1 else 0
        shard = slice(start, start + shard_size)
        # Identical copies of a gradient across the world: TP replicas, and DP replicas unless each DP rank
        # owns a disjoint shard (ZeRO-1; hybrid: one copy per replica group). The global norm sums squares / copies
        # over every rank.
        dp_copies = replica_axis.size if self.zero1 else dp.size

        fp32 = torch.zeros(padded, dtype=torch.float32, device=device)
        # ZeRO-2: the full buffer only exists during a step's backward (_open_grads to _finish).
        grads_sharded = self.zero_stage >= 2 and cut.size > 1
        grad_buffer = torch.zeros(padded, dtype=torch.float32, device=device) if (
            self._flat_grads and not grads_sharded) else None
        segments, offset = [], 0
        for p in params:
            n = p.numel()
            fp32[offset:offset + n].copy_(p.detach().reshape(-1))
            buffer = grad_buffer[offset:offset + n].view(p.shape) if grad_buffer is not None else None
            main = self.main_grads[id(p)] = MainGrad(p, buffer)
            lo, hi = max(offset, shard.start), min(offset + n, shard.stop)
            if lo < hi:
                name = names[id(p)]
                copies = (self.plan[name].tp_copies or self.topo.tp.size) * dp_copies
                if self.plan[name].pipeline_tied:
                    copies *= 2  # the same summed gradient sits on the first and the last stage
                segments.append(Segment(p, main, slice(lo - offset, hi - offset),
                                        slice(lo - shard.start, hi - shard.start), 1.0 / copies))
            offset += n

        # The master copy comes from the fp32 weights before they are cast, so init precision is not lost.
        master = fp32[shard].clone() if self.precision.master_weights else None
        param_buffer = fp32 if self.precision.param_dtype == torch.float32 else fp32.to(self.precision.param_dtype)
        offset = 0
        for p in params:
            n = p.numel()
            p.data = param_buffer[offset:offset + n].view(p.shape)  # the module keeps the same Parameter object
            p.grad = None
            offset += n
        return Bucket(dp, shard_axis, replica_axis, params, decay, param_buffer, grad_buffer, shard, master,
                      segments, grads_sharded=grads_sharded)

    def _open_grads(self, bucket: Bucket) -> None:
        """ZeRO-2: the bucket's full gradient buffer for this step, zeros (its padding too), main grads its views;
        the last step's shard goes first."""
        bucket.grad_shard = None
        for seg in bucket.segments:
            seg.shard_grad = None
        bucket.grad_buffer = torch.zeros(bucket.param_buffer.numel(), dtype=torch.float32,
                                         device=bucket.param_buffer.device)
        offset = 0
        for p in bucket.params:
            self.main_grads[id(p)].buffer = bucket.grad_buffer[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    def _close_grads(self, bucket: Bucket, shard: torch.Tensor | None) -> None:
        """ZeRO-2, after the bucket's reduce-scatter: only the rank's shard is kept (the collective's own output,
        or a copy of the slice it wrote in place); the full buffer goes."""
        bucket.grad_shard = shard if shard is not None else bucket.grad_buffer[bucket.shard].clone()
        for seg in bucket.segments:
            seg.shard_grad = bucket.grad_shard[seg.in_shard]
        bucket.grad_buffer = None
        for p in bucket.params:
            main = self.main_grads[id(p)]
            main.buffer = main.value = None

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s fp32 gradient as the optimizer will read it (ZeRO-2: None once its bucket is reduced; the
        segments hold the rank's shard of it)."""
        return self.main_grads[id(param)].value

    # ---- the phases train_step runs, in order ---------------------------------------------------------------

    def zero_grad(self, micro_batches: int | None = None) -> None:
        """Start a new accumulation: the next backward overwrites each main gradient instead of adding to it.
        micro_batches: how many backward passes this step runs, which lets buckets start reducing during the last
        one (None: every reduction waits for reduce_gradients)."""
        for main in self.main_grads.values():
            main.written = False
            if main.buffer is None:
                # Autograd's tensor from the last step: let it go now, or the next backward's gradients would be
                # allocated while it is still held (two steps' gradients at once).
                main.value = None
        self._pending, self._started = [], 0
        self._remaining = ([b.uses * micro_batches for b in self.buckets]
                           if micro_batches and self._early else None)

    def _on_grad(self, main: MainGrad, index: int, param: nn.Parameter) -> None:
        if self._remaining is not None and self._remaining[index] == 0:
            # Its bucket is already being reduced: adding now would race the collective reading the buffer.
            raise RuntimeError("a gradient arrived after its bucket's reduction started: the step ran more "
                               "backward passes than the micro-batches it announced to zero_grad")
        bucket = self.buckets[index]
        if bucket.grads_sharded and bucket.grad_buffer is None:
            self._open_grads(bucket)
        accumulate(main, param)
        if self._remaining is None:
            return
        self._remaining[index] -= 1
        while self._started < len(self._early) and self._remaining[self._early[self._started]] == 0:
            self._start(self.buckets[self._early[self._started]])
            self._started += 1

    def _start(self, bucket: Bucket) -> None:
        cut = bucket.shard_axis
        if self._max_in_flight is not None and C.reduce_scatter_copies_input(cut):
            while len(self._pending) >= self._max_in_flight:
                self._finish(self._pending.pop(0))
        if self.zero1 and cut.size > 1:  # ZeRO-2 as well: _finish then keeps the shard and lets the full buffer go
            # In place: into the rank's own slice of the buffer it reads (no shard-sized buffer per bucket).
            shard = None if C.in_place_shard_ok(bucket.grad_buffer, cut) else torch.empty_like(
                bucket.grad_buffer[bucket.shard])
            out = bucket.grad_buffer[bucket.shard] if shard is None else shard
            self._pending.append((bucket, C.start_reduce_scatter_flat(out, bucket.grad_buffer, cut), shard))
        elif self.zero1:  # hybrid with shard groups of one: plain replication over the replica group
            self._pending.append((bucket, C.start_all_reduce(bucket.grad_buffer, bucket.replica_axis), None))
        else:
            self._pending.append((bucket, C.start_all_reduce(bucket.grad_buffer, bucket.axis), None))

    def reduce_gradients(self) -> None:
        """Finish the gradients: zeros for parameters no backward reached, sequence-parallel grads summed over
        TP, a pipeline-split tied embedding's grads summed over its first and last stage, then the sum over DP
        (per bucket)."""
        if self.zero3 is not None:
            self.zero3.release_all()  # every backward has run: no parameter is needed before the next forward
        started = set(self._early[:self._started])  # ZeRO-2: reduced during backward, their full buffers gone
        for i, bucket in enumerate(self.buckets):
            if bucket.grads_sharded and bucket.grad_buffer is None and i not in started:
                self._open_grads(bucket)  # no gradient reached it this step
        for p in self.params:
            main = self.main_grads[id(p)]
            if not main.written:
                main.zeros(keep=False)
                main.written = True
        if self._partial and self.topo.tp.size > 1:
            grads = [self.main_grad(p) for p in self._partial]
            flat = torch.cat([g.reshape(-1) for g in grads])
            C.all_reduce(flat, self.topo.tp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view(g.shape))
                offset += g.numel()
        if self._pipeline_tied and self.topo.embedding is not None:
            # Both pipeline copies of a tied embedding take the sum of their gradients, so they stay equal.
            for p in self._pipeline_tied:
                C.all_reduce(self.main_grad(p), self.topo.embedding)
        # Sum, not average: train_step already divides each rank's loss by the global token count. An expert's
        # gradient already holds every EP rank's tokens (they were sent to it), so summing it over the
        # expert-data-parallel group covers the whole global batch.
        early = set(self._early)
        for i in self._early[self._started:]:  # not started during backward (or no overlap): in the same order
            self._start(self.buckets[i])
        for i, bucket in enumerate(self.buckets):
            if bucket.axis.size > 1 and i not in early:
                self._start(bucket)
        for entry in self._pending:
            self._finish(entry)
        self._pending, self._started, self._remaining = [], len(self._early), None

    def _finish(self, entry: tuple[Bucket, C.Pending, torch.Tensor | None]) -> None:
        bucket, pending, shard = entry
        pending.wait()
        if bucket.replica_axis.size > 1 and bucket.shard_axis.size > 1:
            # Hybrid: the shard group's sum, summed again over the replicas holding the same shard (waited on
            # here, not overlapped: a second collective on the same shard).
            C.all_reduce(bucket.grad_buffer[bucket.shard] if shard is None else shard, bucket.replica_axis)
        if bucket.grads_sharded:
            self._close_grads(bucket, shard)
        elif shard is not None:
            bucket.grad_buffer[bucket.shard].copy_(shard)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients over every rank, each distinct value counted once: a 0-d tensor
        on the device (the step reads it back with its other figures, after its graph has run)."""
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for bucket in self.buckets:
            for seg in bucket.segments:
                total += torch.linalg.vector_norm(seg.grad()).square() * seg.norm_weight  # no squared temporary
        C.all_reduce_world(total)  # every rank's distinct share
        return total.sqrt()

    def shard_weights(self, bucket: Bucket) -> list[torch.Tensor]:
        """The fp32 weights of the bucket's shard, one per segment, for the optimizer to update in place: the
        master copy, the parameters themselves when fp32, or fp32 copies of bf16 parameters (bf16SR)."""
        if bucket.master is not None:
            return [bucket.master[seg.in_shard] for seg in bucket.segments]
        params = self._shard_params(bucket)
        return [p if p.dtype == torch.float32 else p.float() for p in params]

    def write_back(self, bucket: Bucket, weights: list[torch.Tensor]) -> None:
        """After the update: cast `weights` to the param dtype (rounding per the precision) and, under ZeRO-1,
        all-gather every rank's shard. Every rank calls it for every bucket (a shard may be only padding)."""
        if self.precision.needs_rounding:
            for param, weight in zip(self._shard_params(bucket), weights):
                param.copy_(self._round(weight))
        cut = bucket.shard_axis
        if self.zero1 and cut.size > 1 and bucket.param_shard is None:  # ZeRO-3: gathered on demand
            shard = bucket.param_buffer[bucket.shard]
            in_place = C.in_place_shard_ok(bucket.param_buffer, cut)
            self._gathers.append(C.start_all_gather_flat(bucket.param_buffer, shard if in_place else shard.clone(),
                                                         cut))
            if not self.overlap_param_gather:
                self.finish_write_back()

    def finish_write_back(self) -> None:
        """Wait for the parameter all-gathers write_back started (ZeRO-1); the weights are whole again after."""
        for pending in self._gathers:
            pending.wait()
        self._gathers = []

    def views(self) -> list[torch.Tensor]:
        """Every parameter that is a view of a flat buffer (the parameters, and tied aliases that follow them):
        what an update of the buffers changes behind the parameters' backs (Device.settle_views)."""
        return self.params + [alias for alias, _ in self._aliases]

    def _shard_params(self, bucket: Bucket) -> list[torch.Tensor]:
        shard = bucket.param_shard if bucket.param_shard is not None else bucket.param_buffer[bucket.shard]
        return [shard[seg.in_shard] for seg in bucket.segments]

    def _round(self, weights: torch.Tensor) -> torch.Tensor:
        if self.precision.stochastic_rounding:
            return stochastic_round_to_bf16(weights, self._sr_generator)
        return weights.to(self.precision.param_dtype)

    def sr_generator_state(self) -> torch.Tensor | None:
        return self._sr_generator.get_state() if self._sr_generator is not None else None

    def load_sr_generator_state(self, state: torch.Tensor | None) -> None:
        if self._sr_generator is not None and state is not None:
            self._sr_generator.set_state(state)


def _split(params: list[nn.Parameter], max_numel: int, units: dict[int, int]) -> list[list[nn.Parameter]]:
    chunks, current, size = [], [], 0
    for p in params:
        if current and (size + p.numel() > max_numel or units.get(id(p)) != units.get(id(current[-1]))):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return chunks + [current] if current else chunks
