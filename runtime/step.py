# One optimizer step over a list of micro-batches (gradient accumulation), and a forward-only eval step.
#
# Micro-batch format: a tuple (input_ids, labels, loss_mask[, position_ids]), each (B, T), B = micro_batch_size:
#   input_ids     LongTensor  tokens[:, :-1] of a (B, T+1) sample
#   labels        LongTensor  tokens[:, 1:]
#   loss_mask     float/bool  1 where the token counts (0 for padding / after end-of-document, if masked), or None
#   position_ids  LongTensor  fine-tuning's packed rows: positions restarting at 0 at every example, which
#                             also resets attention there (runtime.models.layers.SequenceLayout); absent or None:
#                             one causal sequence
#
# Loss normalization (why it matches a single process exactly): the step's loss is the mean over every counted
# token of the global batch, sum(loss * mask) / sum(mask). The denominator is all-reduced over DP before any
# backward, each micro-batch backpropagates its own sum(loss * mask) / global_count, and the DP reduction sums
# gradients. That is the same function of the same tokens however the global batch is split into micro-batches
# and DP ranks (gradient accumulation = global_batch / (micro_batch * dp) micro-batches per rank).
#
# With pipeline parallelism (pp > 1, the model a PipelineStageModel) the micro-batch loop becomes a pipeline
# schedule (runtime/parallel/pipeline): 1F1B, or interleaved 1F1B with virtual stages, forward-only for eval.
from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch
from torch import nn

from runtime.models.layers import SequenceLayout
from runtime.models.moe import set_aux_scale
from runtime.parallel import collectives as C
from runtime.parallel import pipeline
from runtime.parallel.optimizer import ShardedAdamW
from runtime.parallel.topology import Topology

MicroBatch = tuple  # (input_ids, labels, loss_mask | None[, position_ids | None])


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float        # token-weighted mean over the whole global batch, identical on every rank
    grad_norm: float   # global L2 norm before clipping


def train_step(model: nn.Module, optimizer: ShardedAdamW, micro_batches: Sequence[MicroBatch],
               topo: Topology, *, lr: float, clip: float | None, schedule: str | None = None) -> StepResult:
    """Forward/backward every micro-batch, reduce gradients (data parallelism), clip by the global norm, step
    AdamW.

    schedule (pp > 1 only): one of pipeline.SCHEDULES; None picks 1F1B, or interleaved with virtual stages.
    """
    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch")
    model.train()
    batches = [_unpack(mb) for mb in micro_batches]
    total_tokens = _global_token_count(batches, topo)
    grads = optimizer.data_parallel
    grads.zero_grad()
    set_aux_scale(model, 1.0 / (len(batches) * topo.dp.size))  # MoE layers' auxiliary loss, averaged like the loss
    if topo.pp.size > 1:
        loss_sum = pipeline.run_pipeline(model, batches, topo, total_tokens, forward_only=False, schedule=schedule,
                                         autocast=lambda: _autocast(optimizer, batches[0][0].device))
    else:
        loss_sum = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)  # summed on device: one sync
        for input_ids, labels, mask, layout in batches:
            with _autocast(optimizer, input_ids.device):
                per_token = model(input_ids, labels, layout)  # (B, T) fp32
            local = (per_token * mask).sum()
            (local / total_tokens).backward()
            loss_sum += local.detach()
    grads.reduce_gradients()
    grad_norm = optimizer.clip_grad_norm(clip)
    optimizer.step(lr)
    return StepResult(loss=_global_mean(loss_sum, total_tokens, topo), grad_norm=grad_norm)


@torch.no_grad()
def eval_step(model: nn.Module, micro_batches: Sequence[MicroBatch], topo: Topology,
              optimizer: ShardedAdamW | None = None) -> float:
    """Forward-only: the token-weighted mean loss over the micro-batches of every DP rank.

    Pass the optimizer to evaluate under its precision's autocast (the weights' dtype applies regardless).
    """
    model.eval()
    batches = [_unpack(mb) for mb in micro_batches]
    total_tokens = _global_token_count(batches, topo)
    if topo.pp.size > 1:
        loss_sum = pipeline.run_pipeline(model, batches, topo, total_tokens, forward_only=True,
                                         autocast=lambda: _autocast(optimizer, batches[0][0].device))
        return _global_mean(loss_sum, total_tokens, topo)
    loss_sum = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    for input_ids, labels, mask, layout in batches:
        with _autocast(optimizer, input_ids.device):
            loss_sum += (model(input_ids, labels, layout) * mask).sum()
    return _global_mean(loss_sum, total_tokens, topo)


def _unpack(micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SequenceLayout | None]:
    if len(micro_batch) not in (3, 4):
        raise ValueError(f"a micro-batch is (input_ids, labels, loss_mask[, position_ids]); got a "
                         f"{len(micro_batch)}-tuple")
    input_ids, labels, mask = micro_batch[:3]
    position_ids = micro_batch[3] if len(micro_batch) == 4 else None
    if input_ids.shape != labels.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in shape")
    mask = torch.ones(labels.shape, device=labels.device) if mask is None else mask.to(torch.float32)
    layout = None if position_ids is None else SequenceLayout.packed(position_ids)
    return input_ids, labels, mask, layout


def _global_token_count(batches, topo: Topology) -> float:
    # fp32, not fp64 or int64, because not every accelerator's collectives take those (exact to 2^24 tokens).
    count = torch.stack([mask.sum() for _, _, mask, _ in batches]).sum().reshape(1)
    C.all_reduce(count, topo.dp)  # TP ranks see the same tokens; DP ranks see different ones
    total = count.item()
    if total <= 0:
        raise ValueError("every loss_mask in the global batch is zero: nothing to train on")
    return total


def _global_mean(loss_sum: torch.Tensor, total_tokens: float, topo: Topology) -> float:
    loss_sum = loss_sum.reshape(1)
    C.all_reduce(loss_sum, topo.dp)
    return loss_sum.item() / total_tokens


def _autocast(optimizer: ShardedAdamW | None, device: torch.device):
    dtype = optimizer.data_parallel.precision.autocast_dtype if optimizer is not None else None
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
