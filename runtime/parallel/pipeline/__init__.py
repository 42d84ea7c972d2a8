# Pipeline parallelism: a model split into stages by layers (stages.py), schedules that order each rank's forward
# and backward passes (one file each), point-to-point exchange between neighbouring stages (p2p.py: receives posted
# one action early; NXDT_PP_EARLY_RECV=0 posts them just in time), and the executor that runs a schedule
# (executor.py). runtime/step.py calls run_pipeline when pp > 1.
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from runtime.micro_batch import PreparedBatch
from runtime.parallel import collectives as C
from runtime.parallel.pipeline.actions import Action
from runtime.parallel.pipeline.all_forward_all_backward import all_forward_all_backward
from runtime.parallel.pipeline.executor import ScheduleRun
from runtime.parallel.pipeline.forward_only import forward_only as forward_only_schedule
from runtime.parallel.pipeline.interleaved import check_interleaved, interleaved_one_f_one_b
from runtime.parallel.pipeline.one_f_one_b import one_f_one_b
from runtime.parallel.pipeline.p2p import P2P
from runtime.parallel.pipeline.stages import PipelineStageModel, split_into_stages, split_layers
from runtime.parallel.topology import Topology

SCHEDULES = ("1f1b", "interleaved", "all_forward_all_backward")


def schedule_actions(stage: PipelineStageModel, num_micro_batches: int, *, forward_only: bool = False,
                     schedule: str | None = None) -> list[Action]:
    """This rank's actions. Default: 1F1B, or interleaved 1F1B with virtual stages."""
    pp, rank, vpp = stage.pp_size, stage.pp_rank, stage.virtual_pp
    if forward_only:
        return forward_only_schedule(pp, rank, num_micro_batches, vpp)
    schedule = schedule or ("interleaved" if vpp > 1 else "1f1b")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {list(SCHEDULES)}")
    if schedule == "interleaved":
        return interleaved_one_f_one_b(pp, rank, num_micro_batches, vpp)
    if vpp > 1:
        raise ValueError(f"the {schedule} schedule runs one chunk per rank; "
                         f"model.virtual_pipeline_model_parallel_size={vpp} needs the interleaved schedule")
    if schedule == "1f1b":
        return one_f_one_b(pp, rank, num_micro_batches)
    return all_forward_all_backward(pp, rank, num_micro_batches)


def run_pipeline(stage: PipelineStageModel, batches: Sequence[PreparedBatch], topo: Topology,
                 total_tokens: torch.Tensor | Sequence[float], *, forward_only: bool,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 schedule: str | None = None, timeline: list | None = None,
                 objective: Callable | None = None, early_receives: bool | None = None,
                 events: list | None = None) -> torch.Tensor:
    """Run this rank's schedule over `batches`; returns the objective's statistics summed over them (the token
    mean's: sum(loss * mask), a scalar), the same on every pp rank. total_tokens: the objective's totals.
    early_receives: post receives ahead of their passes (None: NXDT_PP_EARLY_RECV, on unless "0"); events: when a
    list, what ScheduleRun records in it (post, received, computed per action)."""
    if not isinstance(stage, PipelineStageModel):
        raise TypeError(f"pp > 1 needs the model parallelize_model split into stages, got {type(stage).__name__}")
    p2p = P2P(prev_rank=topo.prev_stage_rank, next_rank=topo.next_stage_rank)
    run = ScheduleRun(stage, p2p, batches, total_tokens, forward_only=forward_only, autocast=autocast,
                      timeline=timeline, objective=objective, early_receives=early_receives, events=events)
    actions = schedule_actions(stage, len(batches), forward_only=forward_only, schedule=schedule)
    stats = run.run(actions)
    shape = stats.shape if objective is not None else ()
    stats = stats.reshape(-1).contiguous()
    C.all_reduce(stats, topo.pp)  # only the last stage holds non-zero sums
    stage.peak_in_flight = run.peak_in_flight  # for benchmarks/pipeline.py
    return stats.reshape(shape)


def collect_pipeline(stage: PipelineStageModel, batches: Sequence[PreparedBatch], topo: Topology,
                     collect: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     out_shape: Callable[[torch.Tensor], tuple]) -> list[torch.Tensor]:
    """Forward-only over `batches` (the interleaved order with virtual stages); the last stage applies
    collect(logits, labels) to each micro-batch's full logits. Returns the collected tensors, of shape
    out_shape(input_ids) and float32, on every pp rank (broadcast from the last stage)."""
    p2p = P2P(prev_rank=topo.prev_stage_rank, next_rank=topo.next_stage_rank)
    run = ScheduleRun(stage, p2p, batches, 1.0, forward_only=True, collect=collect)
    run.run(schedule_actions(stage, len(batches), forward_only=True))
    out = []
    for index, batch in enumerate(batches):
        value = run.collected.get(index)
        if value is None:
            value = torch.empty(out_shape(batch.input_ids), dtype=torch.float32, device=batch.input_ids.device)
        C.broadcast(value, topo.pp, src_index=topo.pp.size - 1)
        out.append(value)
    return out


__all__ = ["Action", "P2P", "PipelineStageModel", "SCHEDULES", "ScheduleRun", "all_forward_all_backward",
           "check_interleaved", "collect_pipeline", "forward_only_schedule", "interleaved_one_f_one_b",
           "one_f_one_b", "run_pipeline", "schedule_actions", "split_into_stages", "split_layers"]
