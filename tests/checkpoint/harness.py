"""Save and resume inside the gloo processes of tests/runtime_parallel/dist_utils.py, on the tiny models and
batches of tests/runtime_parallel/harness.py, under any tp x pp x dp layout."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from runtime.checkpoint import Checkpointer, load_checkpoint, resolve_checkpoint
from runtime.device import flash_attention_kernels
from runtime.models import build_model
from runtime.parallel import (DataParallelConfig, ParallelDims, ShardedAdamW, Topology, gather_full_state_dict,
                              parallelize_model)
from runtime.parallel import collectives as C
from runtime.schema.model import MoEConfig
from runtime.step import train_step
from tests.runtime_parallel import harness as H

NUM_LAYERS = 4
MOE = MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02)
STEPS = 2  # before the save: an optimizer state with moments and a step count, which the next step then reads


@dataclasses.dataclass(frozen=True)
class L:
    tp: int = 1
    pp: int = 1
    zero1: bool = False
    ep: int = 1
    zero_stage: int | None = None  # DataParallelConfig.zero_stage (2: ZeRO-2); None: from zero1
    cp: int = 1  # context parallelism (ring), carved out of dp like ep
    cuts: tuple[int, ...] | None = None  # model.pipeline_cuts: each stage's last layer but the last's
    num_layers: int = NUM_LAYERS
    shard_degree: int | None = None  # hybrid sharding: ZeRO's shard group size (None: all of dp)

    def __str__(self) -> str:
        return (f"tp{self.tp}_pp{self.pp}" + (f"_ep{self.ep}" if self.ep > 1 else "") +
                (f"_cp{self.cp}" if self.cp > 1 else "") + ("_zero1" if self.zero1 else "") +
                (f"_zero_stage{self.zero_stage}" if self.zero_stage is not None else "") +
                (f"_cuts{'-'.join(map(str, self.cuts))}" if self.cuts else "") +
                (f"_layers{self.num_layers}" if self.num_layers != NUM_LAYERS else "") +
                (f"_shard{self.shard_degree}" if self.shard_degree else ""))


def build(arch: str, layout: L, seed: int):
    # "mixtral": the llama with every MLP a sparse MoE block
    cfg = (H.tiny_config("llama", num_layers=layout.num_layers, seed=seed, moe=MOE) if arch == "mixtral" else
           H.tiny_config(arch, num_layers=layout.num_layers, seed=seed))
    world = dist.get_world_size()
    topo = Topology.build(ParallelDims(tp=layout.tp, pp=layout.pp, dp=world // (layout.tp * layout.pp),
                                       world_size=world, ep=layout.ep, cp=layout.cp), layout.shard_degree)
    model = parallelize_model(build_model(cfg), topo, sequence_parallel=False, pipeline_cuts=layout.cuts,
                              data_parallel=DataParallelConfig("fp32", layout.zero1, zero_stage=layout.zero_stage),
                              attention_kernels=flash_attention_kernels)
    optimizer = ShardedAdamW(model, H.OPTIM)
    return cfg, topo, model, optimizer


def step(cfg, topo, model, optimizer, index: int) -> float:
    return train_step(model, optimizer, H.micro_batches_for(index, cfg.vocab_size, topo), topo,
                      lr=H.OPTIM["lr"], clip=1.0).loss


def save_then_continue(arch: str, layout: L, directory: str, steps: int) -> dict:
    """Train `steps` steps, save, then one more: the un-resharded continuation's loss."""
    cfg, topo, model, optimizer = build(arch, layout, seed=1234)
    for i in range(steps):
        step(cfg, topo, model, optimizer, i)
    ckpt = Checkpointer(directory, rank=dist.get_rank(), world_size=dist.get_world_size(), token="0",
                        async_save=False)
    ckpt.save(steps, model, optimizer, topo, extra={"step": steps}, config={"arch": arch})
    dist.barrier()  # rank 0 committed before anyone reads
    return {"next_loss": step(cfg, topo, model, optimizer, steps)}


def resume_and_step(arch: str, layout: L, directory: str, steps: int, one_replica: bool) -> dict:
    """A differently initialized model under another layout, loaded from the checkpoint, then one step."""
    cfg, topo, model, optimizer = build(arch, layout, seed=99)
    storage, checkpoint = resolve_checkpoint(directory)
    share = one_replica and topo.dp.size > 1
    info = load_checkpoint(storage, checkpoint, model, optimizer, topo, rank=dist.get_rank(),
                           broadcast=C.broadcast if share else None, reader=not share or topo.edp.rank == 0)
    full = {k: v.clone() for k, v in gather_full_state_dict(model, topo).items()}
    loaded_step = optimizer.step_count
    return {"next_loss": step(cfg, topo, model, optimizer, steps), "extra": info["extra"],
            "optimizer_step": loaded_step, "loaded": full}


def suite(arch: str, saved: L, targets: list[L], directory: str, steps: int = STEPS) -> dict:
    out = {"saved": save_then_continue(arch, saved, directory, steps)}
    for i, target in enumerate(targets):
        out[str(target)] = resume_and_step(arch, target, directory, steps, one_replica=i % 2 == 0)
    return out

