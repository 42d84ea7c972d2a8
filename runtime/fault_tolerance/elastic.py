# Elastic data parallelism (run.elastic, issue 62): a job that loses a node and has no spare goes on with the nodes
# left. The job script (attempts.py decides) sets NXDT_ACTIVE_NODES to their count and starts torchrun on that many;
# runtime/train.py's topology then gives data parallelism what tensor and pipeline parallelism leave of the smaller
# world, and every replica reads its share of the same global batches in more micro-batches (runtime/data), so the
# loss curve goes on. The layout one node smaller is checked at launch (schema: training_layout.elastic_rules).
# Torch-free: the job script's side reads the name from here.
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from runtime.schema import rules

if TYPE_CHECKING:
    from runtime.schema.parallel_dims import ParallelDims
    from runtime.schema.training_config import TrainingConfig

ACTIVE_NODES_ENV = "NXDT_ACTIVE_NODES"


def active_nodes(cfg: TrainingConfig, env=os.environ) -> int:
    """trainer.num_nodes, or under run.elastic the nodes the job script started the workers on."""
    value = env.get(ACTIVE_NODES_ENV, "").strip()
    if not value:
        return cfg.trainer.num_nodes
    if not cfg.elastic:
        raise ValueError(f"{ACTIVE_NODES_ENV}={value} starts the run on fewer nodes, but run.elastic is false; set "
                         f"run.elastic=true to go on with fewer data-parallel replicas, or unset {ACTIVE_NODES_ENV}")
    if not value.isdigit() or not 1 <= int(value) <= cfg.trainer.num_nodes:
        raise ValueError(f"{ACTIVE_NODES_ENV}={value!r} must be a node count from 1 to trainer.num_nodes "
                         f"{cfg.trainer.num_nodes} (run.elastic: the nodes left after a lost one)")
    return int(value)


def elastic_line(cfg: TrainingConfig, nodes: int, dims: ParallelDims) -> str:
    """What rank 0 says when the run starts on fewer nodes than trainer.num_nodes; ValueError (one line) where the
    global batch does not split over the smaller data parallelism (checked at launch for one node fewer only)."""
    data = cfg.data
    if problem := rules.global_batch(data.global_batch_size, data.micro_batch_size, dims.batch_dp, ""):
        raise ValueError(f"{ACTIVE_NODES_ENV}={nodes} (run.elastic): {problem}")
    was = cfg.trainer.num_nodes * cfg.trainer.devices // (cfg.parallel.tp * cfg.parallel.pp)
    micro_batches = data.global_batch_size // (data.micro_batch_size * dims.batch_dp)
    return (f"nxdt: elastic: training on {nodes} of {cfg.trainer.num_nodes} nodes, data parallel {dims.dp} (was "
            f"{was}), global batch {data.global_batch_size} kept ({micro_batches} micro-batches per replica)")
