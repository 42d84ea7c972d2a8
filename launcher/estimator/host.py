# Host memory per node for a training config: its worker processes (devices_per_node of them) share the node's
# host memory, and each holds only its own shard of the model there (the runtime builds the model on the meta
# device and materializes each rank's own slices: docs/runtime.md). Per worker:
#   shard state   the rank's weights, gradients, optimizer moments (+ fp32 master weights where the precision keeps
#                 them; ZeRO-1/2/3 divide them by the shard group as memory.py says, ZeRO-3's two gathered units
#                 included) and RoPE tables, as memory.py counts them for the
#                 device: that is what start-up materializes on the host before moving it to the device, and on
#                 CPU it stays there for the whole run, with the activations beside it (`working`)
#   staging       the async checkpoint's host memory beside the state, for a rank that saves both weights and
#                 moments (data-parallel rank 0; without ZeRO-1 only it saves the moments; under ZeRO-3 each rank
#                 its own weight range, not the gathered units): the ring the save
#                 streams the state through, 1/4 of what the rank saves (at most 2 GiB) on an accelerator and 1/16
#                 (at most 256 MiB) on CPU, which writes the state in place (runtime/schema/facts.py
#                 checkpoint_staging_bytes, the rule the runtime sizes it by)
#   data loader   the rank's share of a global batch as the loader stacks it (runtime/data/loader.py) plus a
#                 fixed allowance for the index arrays it keeps (the token files are memory-mapped: page cache)
#   process       the Python + torch + runtime baseline of a worker, measured (PROCESS_OVERHEAD_BYTES)
# LoRA (the peft stage, and alignment with adapters): the frozen weights have no gradients or optimizer state, and a
# checkpoint saves only the adapters: the shard state is the weights, and the adapters' own state (a few MiB at the
# recipes' ranks) is not counted.
# Summed, although on an accelerator the start-up copy of the shard state is freed once it is on the device,
# before the first checkpoint stages its own: an upper bound there by at most the shard state.
from __future__ import annotations

import dataclasses

from launcher.estimator.hardware import GIB, Hardware
from launcher.estimator.memory import Kernels, StageMemory, pipeline_stages
from launcher.estimator.shapes import Layout, ModelShape
from runtime.schema.facts import checkpoint_staging_bytes

MIB = 2**20
# A training worker before its first tensor: 227 MiB resident, measured on this project's CPU build of torch
# (2.13.0+cpu, Python 3.11, Linux x86_64) as the largest VmRSS of each of two idle workers started by
# `python -m runtime.torchrun`, each having imported torch and runtime.train and joined a 2-process gloo group
# (`python -m csp_tools.measure_worker_overhead`, read from outside every 0.1 s; the same on every run). Rounded
# up to 256 MiB. An accelerator's libraries (torch-xla and the Neuron runtime, CUDA) map more; the usable fraction's
# margin below (about 1.6 GiB per worker on a trn1.32xlarge) is what covers them, unmeasured here.
PROCESS_OVERHEAD_BYTES = 256 * MIB
# The loader's own arrays besides the batch: the blend and sample indices of the run's samples (a few bytes per
# sample), the sample-to-document maps it reads through, the fine-tuning rows' epoch order.
DATA_LOADER_FIXED_BYTES = 64 * MIB
BATCH_FIELDS = 4     # input ids, labels, loss mask, position ids (fine-tuning rows: the widest batch), int64 each
BATCH_COPIES = 2     # the stacked samples and the micro-batches cut from them
# Plan for 90% of the node: the kernel, the page cache of memory-mapped token files and checkpoint writes, and
# the file system client (FSx for Lustre) need the rest. AWS ParallelCluster itself tells Slurm only 95% of an
# instance's memory is schedulable (SchedulableMemory's default); the other 5% is the page cache's.
USABLE_FRACTION = 0.9


PEER_STORE_COPIES = 4  # per worker in its node's peer store: 2 nodes' copies x (kept + being written)


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory per worker process, and per node (workers x that)."""
    workers: int                 # worker processes per node (trainer.devices)
    stage: str                   # the pipeline stage whose worker holds the most: first | last | only
    shard_state: float           # weights, gradients, optimizer state and buffers of the worker's shard
    staging: float               # the async checkpoint's host memory beside the worker's state
    data_loader: float
    process: float               # the fixed per-process overhead (measured)
    working: float               # CPU only: activations and the peak working set (the device is the host)
    node_memory_bytes: float     # the node's host memory
    node: str                    # where that figure comes from (the instance, this machine, cluster.node_memory_gib)
    usable_fraction: float = USABLE_FRACTION
    # Peer-held state (fault_tolerance.peer_state_every_n_steps, runtime/checkpoint/peer.py), per worker: its host
    # copy for the refresh, and its share of the node's peer store, which holds two copies of each worker's saved
    # state (its own node's and the previous node's workers'), each twice (the kept one and the one being written).
    peer: float = 0.0
    peer_every: int = 0

    @property
    def peer_store_per_node(self) -> float:
        return self.workers * self.peer * PEER_STORE_COPIES / (PEER_STORE_COPIES + 1)

    @property
    def static_per_worker(self) -> float:
        """What a worker holds whatever the activations: the part a launch refuses on."""
        return self.shard_state + self.staging + self.data_loader + self.process + self.peer

    @property
    def per_worker(self) -> float:
        return self.static_per_worker + self.working

    @property
    def total(self) -> float:
        return self.workers * self.per_worker

    @property
    def static_total(self) -> float:
        return self.workers * self.static_per_worker

    @property
    def usable_bytes(self) -> float:
        return self.node_memory_bytes * self.usable_fraction

    @property
    def fits(self) -> bool:
        return self.total <= self.usable_bytes

    def arithmetic(self, *, static: bool = False) -> str:
        """`32 workers × 9.61 GiB = 307.5 GiB vs 460.8 GiB usable of 512 GiB (trn1.32xlarge)`."""
        per_worker, total = (self.static_per_worker, self.static_total) if static else (self.per_worker, self.total)
        return (f"{self.workers} workers × {per_worker / GIB:.2f} GiB = {total / GIB:.1f} GiB vs "
                f"{self.usable_bytes / GIB:.1f} GiB usable of {self.node_memory_bytes / GIB:g} GiB ({self.node})")


def data_loader_bytes(shape: ModelShape, layout: Layout) -> float:
    """The rank's share of a global batch (global_batch_size / the ranks reading distinct samples), seq + 1 tokens
    per row, as BATCH_FIELDS int64 arrays held BATCH_COPIES times, and the loader's fixed arrays."""
    rows = layout.global_batch_size // max(layout.batch_dp, 1)
    return rows * (shape.seq_length + 1) * 8 * BATCH_FIELDS * BATCH_COPIES + DATA_LOADER_FIXED_BYTES


def host_memory(shape: ModelShape, layout: Layout, hardware: Hardware, kernels: Kernels = Kernels(), *,
                lora: bool = False, peer_every: int = 0) -> HostMemory:
    """Host memory per node of `layout` on `hardware`'s nodes, for the worker that holds the most (the pipeline
    stage with the most state: the first holds the embedding, the last the output layer). `lora`: only adapters
    train (the frozen weights keep no gradients or optimizer state, and checkpoints hold the adapters)."""
    on_cpu = hardware.name == "cpu"
    stages = pipeline_stages(shape, layout, kernels, lora=lora)
    # On CPU the device estimate is host memory: its peak stage; elsewhere the stage with the most state.
    held: StageMemory = max(stages, key=lambda s: s.total if on_cpu else s.static)
    saved = held.weights - held.gathered + held.optimizer  # what the rank's checkpoint holds
    return HostMemory(
        workers=layout.devices_per_node,
        stage=held.stage,
        shard_state=held.static,
        staging=0.0 if lora else checkpoint_staging_bytes(saved, state_on_host=on_cpu),
        data_loader=data_loader_bytes(shape, layout),
        process=PROCESS_OVERHEAD_BYTES,
        working=held.total - held.static if on_cpu else 0.0,
        node_memory_bytes=hardware.node_memory_bytes,
        node=hardware.node,
        peer=(PEER_STORE_COPIES + 1) * saved if peer_every else 0.0,
        peer_every=peer_every,
    )
