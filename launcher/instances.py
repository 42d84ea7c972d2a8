"""The hardware of each instance type and of each device on it, written once (issue 59, one owner per fact): what
the Neuron job scripts (launcher/neuron.py), the Kubernetes pods' resource requests (launcher/k8s.py) and the
estimator (launcher/estimator/hardware.py) know about a node. Each of them builds its own view from these records
and keeps no copy of a number. Torch-free and import-free, like the facts it holds.

Two tables, because two devices can share an instance: INSTANCES has what AWS documents per instance type (chips,
HBM per chip, host memory, EFA), DEVICES what one torch device (one worker process) is on it, keyed by the name the
device goes by everywhere: cluster.neuron.hardware (trn1 | trn2), NXDT_NEURON_HARDWARE in the job script, the
estimator's --device. Workers per node, memory per worker and each worker's share of the node's EFA follow from
the two. Dense BF16 peak FLOP/s per device is runtime/schema/facts.py's PEAK_TFLOPS, by the same names (the
runtime's MFU divides by it too).

The torchrun rendezvous ports are a fact of the cluster kind rather than of the instance: they are written once
below the tables.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Instance:
    """One instance type, as AWS documents it."""

    name: str                   # the EC2 instance type, e.g. trn1.32xlarge
    chips: int                  # accelerator chips: Trainium chips (what aws.amazon.com/neuron counts) or GPUs
    cores_per_chip: int         # physical NeuronCores per Trainium chip; a GPU is one device
    chip_memory_bytes: int      # HBM per chip
    host_memory_gib: int        # the node's memory, shared by its worker processes
    efa_interfaces: int         # EFA network interfaces (what vpc.amazonaws.com/efa counts)
    efa_gbps: float             # GB/s the node's EFA moves (800 Gbps = 100 GB/s), shared by its workers

    @property
    def physical_cores(self) -> int:
        """The node's physical NeuronCores (for a GPU instance, its GPUs)."""
        return self.chips * self.cores_per_chip

    @property
    def host_memory_bytes(self) -> int:
        return self.host_memory_gib * GIB


# trn1.32xlarge: 16 Trainium1 chips of two NeuronCore-v2 each, 32 GiB HBM per chip, 800 Gbps EFA on 8 interfaces.
# trn1n.32xlarge is trn1 silicon with twice the EFA (1600 Gbps on 16 interfaces): same workers, same compiler target.
# trn2.48xlarge: 16 Trainium2 chips of eight NeuronCore-v3 each, 96 GiB HBM per chip, 3.2 Tbps EFAv3 on 16 interfaces.
# p4d.24xlarge: 8 A100 40 GB, 400 Gbps on 4 interfaces (no device row: the estimator has no A100; state
# cluster.node_memory_gib=1152 there). p5.48xlarge / p5e.48xlarge: 8 H100 SXM 80 GB / H200 SXM 141 GB, 3200 Gbps
# on 32 interfaces. Host memory in GiB, as AWS documents each type.
INSTANCES: dict[str, Instance] = {i.name: i for i in (
    Instance("trn1.32xlarge", chips=16, cores_per_chip=2, chip_memory_bytes=32 * GIB, host_memory_gib=512,
             efa_interfaces=8, efa_gbps=100.0),
    Instance("trn1n.32xlarge", chips=16, cores_per_chip=2, chip_memory_bytes=32 * GIB, host_memory_gib=512,
             efa_interfaces=16, efa_gbps=200.0),
    Instance("trn2.48xlarge", chips=16, cores_per_chip=8, chip_memory_bytes=96 * GIB, host_memory_gib=2048,
             efa_interfaces=16, efa_gbps=400.0),
    Instance("p4d.24xlarge", chips=8, cores_per_chip=1, chip_memory_bytes=40 * GB, host_memory_gib=1152,
             efa_interfaces=4, efa_gbps=50.0),
    Instance("p5.48xlarge", chips=8, cores_per_chip=1, chip_memory_bytes=80 * GB, host_memory_gib=2048,
             efa_interfaces=32, efa_gbps=400.0),
    Instance("p5e.48xlarge", chips=8, cores_per_chip=1, chip_memory_bytes=141 * GB, host_memory_gib=2048,
             efa_interfaces=32, efa_gbps=400.0),
)}


@dataclasses.dataclass(frozen=True)
class Device:
    """One torch device, that is one worker process, on an instance type."""

    name: str                   # trn1 | trn2 | trn2-lnc1 | h100 | h200
    description: str
    instance: Instance
    logical_cores: int          # physical cores per worker: the logical NeuronCore config (LNC); 1 on a GPU
    target: str | None          # neuronx-cc --target; None on a GPU
    intra_node_gbps: float      # GB/s one device moves in a collective inside a node
    # What a worker holds besides its tensors: the device runtime or CUDA context, collective buffers, allocator
    # slack.
    process_overhead_bytes: float

    @property
    def workers_per_node(self) -> int:
        """One worker per logical NeuronCore, or per GPU."""
        return self.instance.physical_cores // self.logical_cores

    @property
    def memory_bytes(self) -> int:
        """The HBM one worker has: its chip's, over the workers on the chip."""
        return self.instance.chip_memory_bytes * self.instance.chips // self.workers_per_node

    @property
    def inter_node_gbps(self) -> float:
        """GB/s one device moves when its collective crosses nodes: the node's EFA, shared by its workers."""
        return self.instance.efa_gbps / self.workers_per_node


_TRN1, _TRN2 = INSTANCES["trn1.32xlarge"], INSTANCES["trn2.48xlarge"]
# trn2 at LNC=2 (two physical NeuronCore-v3 per logical core, the default for training: NxD Training's trainer.lnc)
# is 64 workers per node; at LNC=1 (cluster.neuron.lnc=1) each physical core is a worker, with half a logical
# core's memory, compute and link. H100/H200 SXM: NVLink 900 GB/s (450 each way).
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("trn1", "trn1.32xlarge NeuronCore-v2", _TRN1, logical_cores=1, target="trn1", intra_node_gbps=100.0,
           process_overhead_bytes=0.5 * GIB),
    Device("trn2", "trn2.48xlarge logical NeuronCore (LNC=2)", _TRN2, logical_cores=2, target="trn2",
           intra_node_gbps=200.0, process_overhead_bytes=0.5 * GIB),
    Device("trn2-lnc1", "trn2.48xlarge physical NeuronCore (LNC=1)", _TRN2, logical_cores=1, target="trn2",
           intra_node_gbps=100.0, process_overhead_bytes=0.5 * GIB),
    Device("h100", "H100 SXM 80 GB", INSTANCES["p5.48xlarge"], logical_cores=1, target=None, intra_node_gbps=360.0,
           process_overhead_bytes=1.0 * GIB),
    Device("h200", "H200 SXM 141 GB", INSTANCES["p5e.48xlarge"], logical_cores=1, target=None,
           intra_node_gbps=360.0, process_overhead_bytes=1.0 * GIB),
)}

# cluster.neuron.hardware's values: the Trainium rows at their default logical-core config, each named by its
# compiler target (trn2-lnc1 is trn2 under cluster.neuron.lnc=1).
NEURON_HARDWARE: dict[str, Device] = {name: d for name, d in DEVICES.items() if d.target == name}


def at_logical_cores(device: Device, lnc: int) -> Device:
    """`device`'s silicon under another logical-core config: the table's row for it (trn2 at LNC=1 is trn2-lnc1),
    else the same row with the workers per node that config gives."""
    same_silicon = (d for d in DEVICES.values()
                    if d.instance == device.instance and d.target == device.target and d.logical_cores == lnc)
    return next(same_silicon, None) or dataclasses.replace(device, logical_cores=lnc)


@dataclasses.dataclass(frozen=True)
class Ports:
    """torchrun's rendezvous port on a Slurm node: base + job id % span, so two jobs on one node rarely meet."""

    base: int
    span: int


# On Trainium clusters, inside the range the ParallelCluster node script reserves (net.ipv4.ip_local_reserved_ports,
# conf/pcluster/config.yaml node_setup.reserved_ports "44000-44999"), so no outgoing connection can take it first.
NEURON_RENDEZVOUS = Ports(base=44000, span=1000)
# Every other Slurm cluster's jobs (GPU, CPU).
SLURM_RENDEZVOUS = Ports(base=20000, span=20000)
# What a Kubernetes pod's torchrun listens on when the training operator sets neither PET_MASTER_PORT nor
# MASTER_PORT: torchrun's own default.
TORCHRUN_DEFAULT_PORT = 29500
