"""Pipeline-parallel training runs inside the gloo processes, on the tiny models and batches of
tests/runtime_parallel/harness.py (the single-process reference is that module's `train`)."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from runtime.device import flash_attention_kernels
from runtime.models import build_model
from runtime.parallel import (DataParallelConfig, ParallelDims, ShardedAdamW, Topology, gather_full_state_dict,
                              parallelize_model)
from runtime.step import eval_objective, train_step
from tests.runtime_parallel import harness as H

NUM_LAYERS = 4


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    pp: int
    tp: int = 1
    dp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    zero1: bool = False
    zero_stage: int | None = None  # DataParallelConfig.zero_stage (2: ZeRO-2); None: from zero1
    schedule: str | None = None  # None: 1F1B, or interleaved with vpp
    ep: int = 1
    cp: int = 1  # context parallelism: like ep, carved out of the dp ranks (dp counts every replica here)
    cuts: tuple[int, ...] | None = None  # model.pipeline_cuts: each stage's last layer but the last's


def train(arch: str, overrides: dict, layout: PipelineLayout, steps: int = H.STEPS, clip: float = 1.0) -> dict:
    overrides = dict(overrides)
    # 'sft' | 'lora': packed rows; 'dpo', 'dpo-lora', ...: preference pairs (tests/runtime_parallel/harness)
    fine_tuning = overrides.pop("fine_tuning", None)
    cfg = H.tiny_config(arch, **{"num_layers": NUM_LAYERS, **overrides})
    topo = Topology.build(ParallelDims(tp=layout.tp, pp=layout.pp, dp=layout.dp, world_size=dist.get_world_size(),
                                       ep=layout.ep, cp=layout.cp))
    model = parallelize_model(H.fine_tuning_model(cfg, fine_tuning), topo, sequence_parallel=layout.sequence_parallel,
                              virtual_pp=layout.vpp, pipeline_cuts=layout.cuts,
                              data_parallel=DataParallelConfig("fp32", layout.zero1, bucket_numel=H.BUCKET_NUMEL,
                                                                zero_stage=layout.zero_stage),
                              attention_kernels=flash_attention_kernels)
    optimizer = ShardedAdamW(model, H.OPTIM)
    losses, norms = [], []
    metrics = []
    for step in range(steps):
        batches, objective = H.step_inputs(fine_tuning, step, cfg.real_vocab_size, topo)
        result = train_step(model, optimizer, batches, topo, lr=H.OPTIM["lr"], clip=clip, schedule=layout.schedule,
                            objective=objective)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        metrics.append(result.metrics)
    batches, objective = H.step_inputs(fine_tuning, steps, cfg.real_vocab_size, topo)
    eval_loss, eval_metrics = eval_objective(model, batches, topo, objective=objective)
    state = {k: v.float() for k, v in gather_full_state_dict(model, topo).items()}
    plan = {name: {"sharded": p.sharded, "tp_copies": model.sharding_plan.tp_copies(name),
                   "partial_grad": p.partial_grad, "pipeline_tied": p.pipeline_tied}
            for name, p in model.sharding_plan.items()}
    # Parallel state lives in the plan and data parallelism, never on a parameter.
    attributes = sorted({key for param in model.parameters() for key in vars(param)})
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, "state": state, "metrics": metrics,
            "eval_metrics": eval_metrics,
            "pp_rank": topo.pp.rank, "dp_rank": topo.dp.rank, "tp_rank": topo.tp.rank,
            "plan": plan, "parameter_attributes": attributes}


def run_suite(jobs: dict) -> dict:
    """name -> (arch, config overrides, PipelineLayout); every rank returns its own results."""
    return {name: train(arch, overrides, layout) for name, (arch, overrides, layout) in jobs.items()}


def reference(arch: str, overrides: dict) -> dict:
    return H.train_job(arch, {"num_layers": NUM_LAYERS, **overrides}, H.Layout())
