# One optimizer step over a list of micro-batches (gradient accumulation), and a forward-only eval step.
#
# Micro-batches are runtime/micro_batch.py's MicroBatch (input_ids, labels, loss_mask, position_ids, pair_ids;
# a plain tuple of the first 3 to 5 in that order is read as one), prepared once into the PreparedBatch the model,
# the objective and the pipeline read (the mask as float, the positions as a SequenceLayout).
#
# Loss normalization (why it matches a single process exactly): the step's loss is the mean over every counted
# token of the global batch, sum(loss * mask) / sum(mask). The denominator is all-reduced over DP before any
# backward, each micro-batch backpropagates its own sum(loss * mask) / global_count, and the DP reduction sums
# gradients. That is the same function of the same tokens however the global batch is split into micro-batches
# and DP ranks (gradient accumulation = global_batch / (micro_batch * dp) micro-batches per rank).
#
# The same holds for any objective whose loss is a sum over micro-batches of terms divided by global totals: the
# preference losses of the alignment stage (runtime/alignment/objective.py) are sums over pairs / global pairs.
#
# With pipeline parallelism (pp > 1, the model a PipelineStageModel) the micro-batch loop becomes a pipeline
# schedule (runtime/parallel/pipeline): 1F1B, or interleaved 1F1B with virtual stages, forward-only for eval.
from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
from torch import nn

from runtime.micro_batch import MicroBatch, PreparedBatch
from runtime.models.moe import SparseMoE, bias_update, set_aux_scale, start_counting
from runtime.objective import TOKEN_MEAN, TokenMean
from runtime.parallel import collectives as C
from runtime.parallel import pipeline
from runtime.parallel.optimizer import ShardedAdamW
from runtime.parallel.topology import Topology


class StepResult:
    """What one step computed, kept on the device until read: the objective's global statistics, its totals and
    the gradient norm in one tensor. The first read (read(), or any of loss, grad_norm, metrics, tokens) copies
    it to the host once; on XLA, after the step's graph has run (Device.step_boundary), it is the step's one
    device-to-host transfer, and nothing the step computed waits on the host before that."""

    def __init__(self, values: torch.Tensor, objective: TokenMean, num_stats: int, num_extra: int = 0):
        self.values, self._objective, self._num_stats, self._num_extra = values, objective, num_stats, num_extra
        self._read: tuple[float, float, dict, float, list[float]] | None = None

    def read(self, *, check: bool = True) -> "StepResult":
        """check: refuse a global batch with no counted token (False where the values are placeholders: under
        neuron_parallel_compile every value read is zero). The refusal comes after the step: its update has divided
        by zero tokens, so the caller must stop (the training does, before anything is saved)."""
        if self._read is None:
            values = self.values.tolist()
            extra = values[len(values) - self._num_extra:]
            values = values[:len(values) - self._num_extra]
            stats, totals, grad_norm = values[:self._num_stats], values[self._num_stats:-1], values[-1]
            if check and totals[0] <= 0:
                raise ValueError("every loss_mask in the global batch is zero: nothing to train on")
            loss, metrics = self._objective.report(stats, totals) if totals[0] > 0 else (math.nan, {})
            self._read = (loss, grad_norm, metrics, totals[0], extra)
        return self

    @property
    def loss(self) -> float:  # the objective over the whole global batch (token-weighted mean), the same on every rank
        return self.read()._read[0]

    @property
    def grad_norm(self) -> float:  # global L2 norm before clipping (nan for an evaluation)
        return self.read()._read[1]

    @property
    def metrics(self) -> dict:  # the objective's other figures (preference rewards)
        return self.read()._read[2]

    @property
    def tokens(self) -> float:  # the objective's first total: counted tokens (pairs for a preference objective)
        return self.read()._read[3]

    @property
    def extra(self) -> list[float]:  # train_step's read_with, read back with the step's own figures
        return self.read()._read[4]


def train_step(model: nn.Module, optimizer: ShardedAdamW, micro_batches: Sequence[MicroBatch | tuple],
               topo: Topology, *, lr: float, clip: float | None, schedule: str | None = None,
               objective: TokenMean | None = None, read_with: torch.Tensor | None = None) -> StepResult:
    """Forward/backward every micro-batch, reduce gradients (data parallelism), clip by the global norm, step
    AdamW.

    schedule (pp > 1 only): one of pipeline.SCHEDULES; None picks 1F1B, or interleaved with virtual stages.
    objective: TOKEN_MEAN (None), or the alignment stage's preference objective.
    read_with: other device values (fp32) to read back in the step's one read (StepResult.extra): the preemption
    flag, which then costs no read of its own.
    """
    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch")
    objective = objective or TOKEN_MEAN
    batches = objective.prepare(model, _prepare(micro_batches), topo)
    model.train()
    totals = _global_totals(objective, batches, topo)  # on the device: nothing here reads it back
    grads = optimizer.data_parallel
    grads.zero_grad(len(batches))  # buckets start reducing during the last micro-batch's backward
    set_aux_scale(model, 1.0 / (len(batches) * topo.dp.size))  # MoE layers' auxiliary loss, averaged like the loss
    rate = bias_update_rate(model, optimizer)
    balanced = start_counting(model) if rate else []
    if topo.pp.size > 1:
        stats = pipeline.run_pipeline(model, batches, topo, totals, forward_only=False, schedule=schedule,
                                      autocast=lambda: autocast_for(optimizer, batches[0].input_ids.device),
                                      objective=objective)
    else:
        stats = None  # summed on device
        for batch in batches:
            with autocast_for(optimizer, batch.input_ids.device):
                per_token = model(batch.input_ids, batch.labels, batch.layout)  # (B, T) fp32
            loss, local = objective(per_token, batch, totals)
            loss.backward()
            stats = local if stats is None else stats + local
    grads.reduce_gradients()
    grad_norm = optimizer.clip_grad_norm(clip)  # a device tensor; clipping is arithmetic on it, not a branch
    optimizer.step(lr, add=_selection_bias_changes(balanced, rate, topo))
    values = _values(stats, topo, totals, grad_norm)
    if read_with is None:
        return StepResult(values, objective, objective.num_stats)
    extra = read_with.reshape(-1).to(values.dtype)
    return StepResult(torch.cat([values, extra]), objective, objective.num_stats, extra.numel())


def bias_update_rate(model: nn.Module, optimizer: ShardedAdamW) -> float:
    """model.moe.router_bias_update_rate of the model's config (0.0 without one). The schema's rules refuse a
    nonzero rate without model.moe.score_bias or under LoRA at launch; this is the same refusal for a model built in
    code, and for an architecture whose MoE layers have no selection bias."""
    moe = getattr(getattr(model, "cfg", None), "moe", None)
    rate = moe.router_bias_update_rate if moe is not None else 0.0
    if rate:
        owned = {id(p) for _, p in optimizer.data_parallel.named_params}
        layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        frozen = [m for m in layers if m.selection is not None and id(m.selection.bias) not in owned]
        if any(m.selection is None for m in layers) or frozen:
            raise ValueError(f"training.model.moe.router_bias_update_rate: {rate} updates the expert selection bias, "
                             f"which {'LoRA keeps frozen' if frozen else 'these MoE layers do not have'} (model.moe."
                             f"score_bias=true, architecture={model.cfg.architecture}); set it to 0.0")
    return rate


def _selection_bias_changes(biases: list, rate: float, topo: Topology) -> dict[int, torch.Tensor] | None:
    """The step's change of every counting selection bias: their loads over the global batch (this rank's
    micro-batches, summed over the data-parallel group, which holds the expert- and context-parallel ranks too; TP
    ranks route the same tokens), in one all-reduce for all layers."""
    if not biases:
        return None
    loads = C.all_reduce(torch.stack([bias.routed for bias in biases]), topo.dp)
    for bias in biases:
        bias.routed = None
    return {id(bias.bias): change for bias, change in zip(biases, bias_update(loads, rate))}


@torch.no_grad()
def eval_step(model: nn.Module, micro_batches: Sequence[MicroBatch | tuple], topo: Topology,
              optimizer: ShardedAdamW | None = None) -> float:
    """Forward-only: the token-weighted mean loss over the micro-batches of every DP rank.

    Pass the optimizer to evaluate under its precision's autocast (the weights' dtype applies regardless).
    """
    return eval_objective(model, micro_batches, topo, optimizer)[0]


@torch.no_grad()
def eval_objective(model: nn.Module, micro_batches: Sequence[MicroBatch | tuple], topo: Topology,
                   optimizer: ShardedAdamW | None = None, objective: TokenMean | None = None
                   ) -> tuple[float, dict[str, float]]:
    """Forward-only: the objective's loss and metrics over the micro-batches of every DP rank."""
    result = eval_result(model, micro_batches, topo, optimizer, objective)
    return result.loss, result.metrics


@torch.no_grad()
def eval_result(model: nn.Module, micro_batches: Sequence[MicroBatch | tuple], topo: Topology,
                optimizer: ShardedAdamW | None = None, objective: TokenMean | None = None) -> StepResult:
    """eval_objective's figures, still on the device (read them after the graph has run, on XLA)."""
    objective = objective or TOKEN_MEAN
    batches = objective.prepare(model, _prepare(micro_batches), topo)
    model.eval()
    totals = _global_totals(objective, batches, topo)
    if topo.pp.size > 1:
        stats = pipeline.run_pipeline(model, batches, topo, totals, forward_only=True, objective=objective,
                                      autocast=lambda: autocast_for(optimizer, batches[0].input_ids.device))
    else:
        stats = None
        for batch in batches:
            with autocast_for(optimizer, batch.input_ids.device):
                local = objective(model(batch.input_ids, batch.labels, batch.layout), batch, totals)[1]
            stats = local if stats is None else stats + local
    no_norm = torch.full((), math.nan, device=totals.device)
    return StepResult(_values(stats, topo, totals, no_norm), objective, objective.num_stats)


def _prepare(micro_batches: Sequence[MicroBatch | tuple]) -> list[PreparedBatch]:
    return [MicroBatch.of(micro_batch).prepare() for micro_batch in micro_batches]


def _global_totals(objective: TokenMean, batches: list[PreparedBatch], topo: Topology) -> torch.Tensor:
    # fp32, not fp64 or int64, because not every accelerator's collectives take those (exact to 2^24 tokens).
    totals = objective.totals(batches).to(torch.float32)
    return C.all_reduce(totals, topo.dp)  # TP ranks see the same tokens; DP ranks see different ones


def _values(stats: torch.Tensor, topo: Topology, totals: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """[global statistics..., totals..., grad norm]: what a step hands back, in one tensor for one read."""
    stats = stats.reshape(-1)
    C.all_reduce(stats, topo.dp)
    return torch.cat([stats, totals.reshape(-1), grad_norm.reshape(1).to(stats.dtype)])


def autocast_for(optimizer: ShardedAdamW | None, device: torch.device):
    dtype = optimizer.data_parallel.precision.autocast_dtype if optimizer is not None else None
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
