# What the estimator needs to know about an accelerator: memory and peak FLOP/s per device (one torch device =
# one worker process: a NeuronCore, a GPU, or a CPU process), devices per node, and rough collective bandwidths.
# The conf/cluster group describes Slurm settings, not hardware, so the target is named here: by the recipe's
# trainer.accelerator and trainer.devices (see `detect`), or explicitly with `nxdt-launch estimate --device`.
from __future__ import annotations

import dataclasses
import os

from launcher.errors import UserError
from launcher.instances import DEVICES, GIB, INSTANCES, Device
from runtime.schema.facts import PEAK_TFLOPS  # the runtime's MFU divides by the same table


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


# The devices and their instances are launcher/instances.py's (memory, workers and links per node, host memory);
# peak FLOP/s runtime/schema/facts.py's. What is the estimator's own: the MFU it assumes.
DEFAULT_MFU = 0.40
# Host memory per instance type, GiB (p4d is A100, which the estimator has no device row for: state
# cluster.node_memory_gib there).
NODE_MEMORY_GIB = {name: instance.host_memory_gib for name, instance in INSTANCES.items()}


def _estimated(device: Device) -> Hardware:
    return Hardware(device.name, device.description, device.memory_bytes, PEAK_TFLOPS[device.name],
                    device.workers_per_node, device.intra_node_gbps, device.inter_node_gbps, DEFAULT_MFU,
                    process_overhead_bytes=device.process_overhead_bytes,
                    node_memory_bytes=device.instance.host_memory_bytes, node=device.instance.name)


HARDWARE: dict[str, Hardware] = {name: _estimated(device) for name, device in DEVICES.items()}
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
        return next((name for name, device in DEVICES.items()
                     if device.target is not None and device.workers_per_node == devices_per_node), "trn1")
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
