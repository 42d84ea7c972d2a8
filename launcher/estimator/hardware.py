# What the estimator needs to know about an accelerator: memory and peak FLOP/s per device (one torch device =
# one worker process: a NeuronCore, a GPU, or a CPU process), devices per node, and rough collective bandwidths.
# The conf/cluster group describes Slurm settings, not hardware, so the target is named here: by the recipe's
# trainer.accelerator and trainer.devices (see `detect`), or explicitly with `nxdt-launch estimate --device`.
from __future__ import annotations

import dataclasses
import os

from launcher.errors import UserError
from runtime.schema.facts import PEAK_TFLOPS  # the runtime's MFU divides by the same table

GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str                    # trn1 | trn2 | h100 | h200 | cpu
    description: str
    memory_bytes: float          # per device
    peak_tflops: float           # dense BF16 per device, facts.PEAK_TFLOPS (CPU: an assumed figure, see below)
    devices_per_node: int
    intra_node_gbps: float       # GB/s one device moves in a collective inside a node
    inter_node_gbps: float       # GB/s one device moves when its collective crosses nodes (NIC shared by the node)
    default_mfu: float           # the model-FLOPs utilization time estimates assume unless --mfu says otherwise
    # What a worker needs besides its tensors: runtime/context, collective buffers, allocator slack. On CPU it is
    # the Python + torch baseline of each process (about 0.4 GiB resident before the first tensor).
    process_overhead_bytes: float = 0.0
    usable_fraction: float = 0.9  # fragmentation: plan for 90% of the memory, not all of it
    # The node's host memory, shared by its devices_per_node worker processes (launcher/estimator/host.py), and
    # where that figure comes from: the instance whose documented memory it is (NODE_MEMORY_GIB), this machine,
    # or cluster.node_memory_gib, which overrides the instance's.
    node_memory_bytes: float = 0.0
    node: str = ""

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_fraction - self.process_overhead_bytes


# trn1.32xlarge: 16 Trainium1 chips = 32 NeuronCore-v2, 512 GiB HBM (16 GiB per core), 800 Gbps EFA per node.
# trn2.48xlarge at LNC=2 (two physical NeuronCore-v3 per logical core, the default for training): 16 Trainium2
# chips x 4 logical cores = 64 workers; 96 GiB HBM per chip, 3.2 Tbps EFAv3 per node. H100/H200 SXM: 8 per node,
# NVLink 900 GB/s (450 each way), 400 Gbps per GPU. Peak FLOP/s: runtime/schema/facts.py.
# Host memory per instance, GiB, as AWS documents each instance type (trn1n is trn1 with more EFA; p4d is A100,
# which the estimator has no device row for: set cluster.node_memory_gib=1152 there).
NODE_MEMORY_GIB = {"trn1.32xlarge": 512, "trn1n.32xlarge": 512, "trn2.48xlarge": 2048, "p4d.24xlarge": 1152,
                   "p5.48xlarge": 2048, "p5e.48xlarge": 2048}


def _node(instance: str) -> dict:
    return {"node": instance, "node_memory_bytes": NODE_MEMORY_GIB[instance] * GIB}


HARDWARE: dict[str, Hardware] = {
    "trn1": Hardware("trn1", "trn1.32xlarge NeuronCore-v2", 16 * GIB, PEAK_TFLOPS["trn1"], 32, 100.0, 100.0 / 32,
                     0.40, process_overhead_bytes=0.5 * GIB, **_node("trn1.32xlarge")),
    "trn2": Hardware("trn2", "trn2.48xlarge logical NeuronCore (LNC=2)", 24 * GIB, PEAK_TFLOPS["trn2"], 64, 200.0,
                     400.0 / 64, 0.40, process_overhead_bytes=0.5 * GIB, **_node("trn2.48xlarge")),
    # LNC=1: each physical NeuronCore-v3 a worker, with half a logical core's memory, compute and link.
    "trn2-lnc1": Hardware("trn2-lnc1", "trn2.48xlarge physical NeuronCore (LNC=1)", 12 * GIB, PEAK_TFLOPS["trn2-lnc1"],
                          128, 100.0, 400.0 / 128, 0.40, process_overhead_bytes=0.5 * GIB, **_node("trn2.48xlarge")),
    "h100": Hardware("h100", "H100 SXM 80 GB", 80 * GB, PEAK_TFLOPS["h100"], 8, 360.0, 50.0, 0.40,
                     process_overhead_bytes=1.0 * GIB, **_node("p5.48xlarge")),
    "h200": Hardware("h200", "H200 SXM 141 GB", 141 * GB, PEAK_TFLOPS["h200"], 8, 360.0, 50.0, 0.40,
                     process_overhead_bytes=1.0 * GIB, **_node("p5e.48xlarge")),
}
DEVICE_NAMES = (*HARDWARE, "cpu")

# A CPU worker's achieved fp32 matmul rate varies tenfold between a laptop core and a server socket, so the peak
# table has no CPU row: the runtime measures it at start (runtime/metrics.py). Estimates use this figure per worker
# process unless told otherwise.
CPU_ASSUMED_TFLOPS = 0.2


def host_memory_bytes() -> float:
    """Physical memory of this machine: the default node memory for cpu estimates."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 64.0 * GIB


def cpu_hardware(devices_per_node: int, node_memory_bytes: float | None = None) -> Hardware:
    """A CPU node's memory is shared by its worker processes: each gets host memory / processes."""
    memory = node_memory_bytes if node_memory_bytes is not None else host_memory_bytes()
    processes = max(int(devices_per_node), 1)
    return Hardware("cpu", f"CPU worker ({processes} per node, {memory / GIB:.0f} GiB host memory)",
                    memory / processes, CPU_ASSUMED_TFLOPS, processes, 5.0, 1.0, 0.5,
                    process_overhead_bytes=0.4 * GIB, node_memory_bytes=memory,
                    node="this machine" if node_memory_bytes is None else "cluster.node_memory_gib")


def detect(accelerator: str, devices_per_node: int) -> str:
    """The device a recipe targets, from the keys the runtime reads: neuron with 64 workers per node is a trn2
    node at LNC=2, 128 one at LNC=1, other neuron counts trn1; gpu means H100 (say --device h200 for H200); cpu is
    cpu."""
    if accelerator == "neuron":
        return {64: "trn2", 128: "trn2-lnc1"}.get(devices_per_node, "trn1")
    if accelerator == "gpu":
        return "h100"
    return "cpu"


def hardware_for(name: str, devices_per_node: int, node_memory_bytes: float | None = None) -> Hardware:
    """`node_memory_bytes`: the node's host memory when the cluster states it (cluster.node_memory_gib); else the
    instance's (NODE_MEMORY_GIB), and for cpu this machine's."""
    if name == "cpu":
        return cpu_hardware(devices_per_node, node_memory_bytes)
    if name not in HARDWARE:
        raise UserError(f"device {name!r} is unknown; valid devices: {', '.join(DEVICE_NAMES)}")
    if node_memory_bytes is None or node_memory_bytes == HARDWARE[name].node_memory_bytes:
        return HARDWARE[name]
    return dataclasses.replace(HARDWARE[name], node_memory_bytes=float(node_memory_bytes),
                               node="cluster.node_memory_gib")
