# The one module that knows which accelerator it runs on: cpu (gloo), cuda (nccl) or xla (torch-xla PJRT,
# i.e. Trainium NeuronCores). Everything else asks the Device object instead of branching on the kind.
from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import tempfile
import threading
import warnings
from dataclasses import dataclass, field

import torch

from runtime.parallel import topology

# trainer.accelerator (NeMo's names) -> the torch device kind it runs on.
ACCELERATOR_KINDS = {"cpu": "cpu", "gpu": "cuda", "neuron": "xla"}
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}


@dataclass
class Device:
    kind: str  # cpu | cuda | xla
    torch_device: torch.device
    rank: int
    world_size: int
    local_rank: int
    hardware: str  # a key of facts.PEAK_TFLOPS (runtime/schema/facts.py) when known, else a description
    _xla: dict = field(default_factory=dict, repr=False)  # lazily imported torch_xla modules
    _store_file: str | None = field(default=None, repr=False)  # the single-process group's rendezvous file

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def step_boundary(self) -> None:
        """Call once per training step: XLA traces lazily and only compiles/executes the graph here."""
        if self.kind == "xla":
            torch_xla = self._xla["torch_xla"]
            sync = getattr(torch_xla, "sync", None)
            sync() if sync is not None else self._xla["xm"].mark_step()

    def synchronize(self) -> None:
        """Wait until queued device work is done, so a wall-clock timing covers it."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self.kind == "xla":
            self._xla["xm"].wait_device_ops()

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        if self.kind == "xla":
            self._xla["xm"].rendezvous("nxdt_barrier")
        else:
            topology.world_barrier([self.torch_device.index] if self.kind == "cuda" else None)

    @property
    def defers_staging_copy(self) -> bool:
        """Checkpoint staging: an async save streams the live state to its file until the next update changes it
        (runtime/checkpoint/staging.py), on every device; checkpoint_transfer says how its bytes reach the host."""
        return True

    @property
    def pins_host_memory(self) -> bool:
        """Checkpoint staging buffers are page-locked where that speeds device-to-host copies (CUDA)."""
        return self.kind == "cuda"

    def rng_state(self) -> dict:
        """This device's own random state beyond torch's CPU generator (what a checkpoint must restore)."""
        return {"cuda": torch.cuda.get_rng_state(self.torch_device)} if self.kind == "cuda" else {}

    def set_rng_state(self, state: dict) -> None:
        if self.kind == "cuda" and state.get("cuda") is not None:
            torch.cuda.set_rng_state(state["cuda"], self.torch_device)

    def memory_gib(self) -> float:
        """Peak memory of this process: device memory on CUDA, host resident set elsewhere."""
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.torch_device) / 2**30
        return self.host_peak_gib()

    @staticmethod
    def host_peak_gib() -> float:
        """This process's peak resident set since it started (the kernel's high-water mark, ru_maxrss: KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def device_peak_gib(self) -> float | None:
        """Peak device memory where the device reports it (CUDA); None elsewhere."""
        return torch.cuda.max_memory_allocated(self.torch_device) / 2**30 if self.kind == "cuda" else None

    def graph_counts(self) -> "GraphCounts | None":
        """XLA only: how many graphs this process has compiled and executed, and how many device-to-host transfers
        it made, so far (torch-xla's debug metrics); None on other devices, which run no graphs."""
        if self.kind != "xla":
            return None
        met = self._xla["met"]
        # Counters where torch-xla keeps them (ExecuteTime's samples lag further). ExecuteComputation is counted
        # by the execution thread once a graph has run: GraphAccounting waits for the device before it reads them.
        # A transfer is synchronous: its metric is recorded before the read returns. A checkpoint writer's own
        # transfers (XlaTransfer, on its thread, whichever part the training thread is in) are counted apart.
        with XlaTransfer.lock:
            transfers = met.metric_data("TransferFromDeviceTime")
            return GraphCounts(int(met.counter_value("UncachedCompile") or 0),
                               int(met.counter_value("ExecuteComputation") or 0),
                               (int(transfers[0]) if transfers else 0) - XlaTransfer.transfers)

    def settle_views(self, views: list[torch.Tensor]) -> None:
        """XLA: bring views of a buffer that was updated in place (the parameters in data parallelism's flat
        buffers, DataParallel.views) up to date now, inside the graph being traced. torch-xla's functionalization
        would regenerate them lazily in whichever graph reads them next: the next step's, or, once a validation
        has read them, not the next step's, which would then be a different graph, compiled after every first
        validation. Elsewhere a view is always current."""
        if self.kind == "xla":
            for view in views:
                torch._sync(view)

    @property
    def trial_run(self) -> bool:
        """The job script's compile step (compile_trial_run): checks on values read from the device (a zero token
        count, a non-finite loss, the preflight's sums, a signal) would stop the compile, so they are skipped."""
        return self.kind == "xla" and compile_trial_run()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self.kind == "xla":
            self._xla["xm"].set_rng_state(seed)


@dataclass(frozen=True)
class GraphCounts:
    compiles: int
    executions: int
    transfers: int  # device to host

    def __sub__(self, other: "GraphCounts") -> "GraphCounts":
        return GraphCounts(self.compiles - other.compiles, self.executions - other.executions,
                           self.transfers - other.transfers)

    def __add__(self, other: "GraphCounts") -> "GraphCounts":
        return GraphCounts(self.compiles + other.compiles, self.executions + other.executions,
                           self.transfers + other.transfers)


def compile_trial_run() -> bool:
    """Whether this process is the job script's Neuron compile step (templates/sbatch.sh.j2 sets NXDT_COMPILE=1
    around neuron_parallel_compile), which runs the training to extract its graphs and hands back zeros for every
    value read from the device."""
    return os.environ.get("NXDT_COMPILE") == "1"


def fetch_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Host copies of XLA tensors, all in one transfer: one graph computes every pending value (a slice, a view)
    and one synchronization brings them back. Copied one by one, each would be its own graph, compiled on its
    first save (one per tensor). Host tensors among them (a sharded parameter's row index) are cloned. None where
    none is on an XLA device (copy them as usual). The graph materializes the copies on the device first: one
    checkpoint's worth of device memory, until the transfer is done."""
    on_xla = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    if not on_xla:
        return None
    import torch_xla

    # Clones, not the tensors: fetching a view gives it its own device data, and the next step's graph, reading
    # the parameters through their views no longer, would be a new one (compiled again after every first save).
    fetched = iter(torch_xla._XLAC._xla_get_cpu_tensors([tensors[i].detach().clone() for i in on_xla]))
    wanted = set(on_xla)
    return [next(fetched) if i in wanted else t.detach().clone() for i, t in enumerate(tensors)]


class HostTransfer:
    """How an asynchronous checkpoint's bytes reach the host (runtime/checkpoint/staging.py), for host tensors: the
    writer reads them in place, and a copy (the update's, into a ring slot) is a memcpy. The accelerators' kinds
    below differ only in this transfer; checkpoint_transfer picks one by where the tensors are."""

    in_place = True        # the writer may read the live tensors themselves
    whole_tensors = False  # False: any byte range of a tensor transfers alone (chunks); True: only whole tensors
    pin = False            # ring slots page-locked

    def __init__(self, bases: list[torch.Tensor]):
        self._flat = [t.detach().reshape(-1).view(torch.uint8) for t in bases]

    def live(self, base: int, start: int, end: int) -> torch.Tensor:
        """Bytes [start, end) of base tensor `base` where they are (host memory here)."""
        return self._flat[base][start:end]

    def fetch(self, base: int, start: int, end: int, into: torch.Tensor | None) -> torch.Tensor:
        """Bytes [start, end) of base `base` on the host, in `into` (a ring slot's bytes) when given."""
        return into.copy_(self.live(base, start, end))

    def release(self) -> None:
        """Nothing more is fetched (the update may change the tensors): drop what pins the saved values."""


class CudaTransfer(HostTransfer):
    """GPU: chunks copied into page-locked ring slots on a side stream, after the work that produced the saved step
    (an event recorded at the save), each waited for by its own event on the thread that asked for it (the
    writer, or the update before it runs)."""

    in_place, pin = False, True

    def __init__(self, bases: list[torch.Tensor]):
        super().__init__(bases)
        self._stream = torch.cuda.Stream(bases[0].device)
        self._stream.wait_event(torch.cuda.current_stream(bases[0].device).record_event())

    def fetch(self, base, start, end, into):
        with torch.cuda.stream(self._stream):
            into.copy_(self.live(base, start, end), non_blocking=True)
            done = self._stream.record_event()
        done.synchronize()
        return into

    def release(self) -> None:
        self._flat = []


class XlaTransfer(HostTransfer):
    """XLA: whole tensors, each as it is on the device. A tensor that is device data transfers without a graph;
    a slice of one would be a graph of its own (a compile, minutes on Neuron). The save takes a handle on each
    tensor's device buffer (no graph), which the writer thread transfers while the training thread traces the
    next step; the step's graph donates the buffers it updates in place, so every transfer must be done before
    it runs (the update's freeze). Transfers are counted apart from the training thread's (graph_counts)."""

    in_place, whole_tensors = False, True
    lock = threading.Lock()
    transfers = 0  # made by checkpoint writers in this process, so far

    def __init__(self, bases: list[torch.Tensor]):
        import torch_xla

        self._xlac = torch_xla._XLAC
        self._handles: list[torch.Tensor | None] = []
        for base in bases:
            _, found = self._xlac._get_tensors_xla_device_data_node([base])
            # One device buffer of the base's shape: the base holds a value computed and stored on the device,
            # not a pending computation (whose inputs would be found instead).
            assert len(found) == 1 and found[0].shape == base.shape, "save a step whose graph has run"
            self._handles.append(found[0])

    def live(self, base, start, end):
        raise AssertionError("XLA tensors transfer whole")

    def fetch(self, base, start, end, into):
        handle = self._handles[base]
        with XlaTransfer.lock:
            [host] = self._xlac._xla_get_cpu_tensors([handle])
            XlaTransfer.transfers += 1
        self._handles[base] = None  # its buffer may be donated now
        return host.reshape(-1).view(torch.uint8)[start:end]

    def release(self) -> None:
        self._handles = []


def checkpoint_transfer(tensor: torch.Tensor | None) -> type[HostTransfer]:
    """The transfer for a save of tensors on `tensor`'s device (None: host tensors)."""
    kind = tensor.device.type if tensor is not None else "cpu"
    return {"cuda": CudaTransfer, "xla": XlaTransfer}.get(kind, HostTransfer)


def release_freed_host_memory() -> None:
    """Hand the host memory the allocator holds freed back to the system (glibc's malloc_trim; elsewhere nothing).

    Start-up frees as much as it keeps: data parallelism copies each materialized parameter into its flat buffer
    and drops the original. glibc serves tensors under its mmap threshold (which grows to 32 MiB as big tensors
    are freed) from its heaps and keeps what is freed there, so without this the rank would carry a second copy
    of its weights in its resident set for the whole run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _cuda_hardware(index: int) -> str:
    """The peak table's key for a GPU it knows ("NVIDIA H100 80GB HBM3" is h100), else torch's name for it."""
    name = torch.cuda.get_device_name(index)
    for known in ("h200", "h100"):
        if known in name.lower():
            return known
    return name


def _attempt_store(rank: int, world_size: int):
    """Under torchrun, the rendezvous store with a prefix per restart attempt (None elsewhere).

    torchrun's workers share the agent's TCPStore, which outlives a restart (--max-restarts): without a prefix,
    restarted workers can read the previous attempt's keys, such as gloo's peer addresses, and dial processes
    that are gone. TORCHELASTIC_RESTART_COUNT names the attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return topology.attempt_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size,
                                  attempt, agent_store=agent_store)


def _xla_device() -> tuple[torch.device, str, dict]:
    """trainer.accelerator 'neuron': torch-xla imported and set up (before any graph is compiled), and this
    process's XLA device; (device, hardware, the torch_xla modules Device keeps)."""
    # Every Python number an op takes becomes a graph input, never a constant: torch-xla inlines 0 and 1, so a
    # learning rate decayed to 0 or an Adam bias correction that rounds to 1 (step 730 at beta2 0.95) would
    # otherwise make a new step graph, compiled long after warm-up.
    os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")
    try:  # torch-xla lives in its own environment; import it only when asked for
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" process-group backend
        import torch_xla.runtime as xr
    except ImportError as error:
        raise ValueError(
            f"trainer.accelerator 'neuron' needs torch-xla (pip install torch-neuronx): {error}"
        ) from None
    # XLA's persistent compilation cache, where torch-xla's runtime supports it (TPU, GPU): before any graph is
    # compiled. On Neuron the compiled graphs live in Neuron's own cache (NEURON_COMPILE_CACHE_URL, which the
    # launcher's compile step fills); this one is XLA's, keyed by the same graph hashes.
    if os.environ.get("NXDT_XLA_CACHE_DIR"):
        xr.initialize_cache(os.environ["NXDT_XLA_CACHE_DIR"], readonly=False)
    torch_device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
    hardware = os.environ.get("NXDT_NEURON_HARDWARE", "trn1")
    return torch_device, hardware, {"torch_xla": torch_xla, "xm": xm, "xr": xr, "met": met}


def init_device(accelerator: str) -> Device:
    """Pick the device for `trainer.accelerator` and join the process group torchrun describes.

    Without torchrun's environment (RANK/WORLD_SIZE unset) this is a one-process group, so the same code path
    (and the same Topology) serves `python -m runtime.train` on a laptop.
    """
    if accelerator not in ACCELERATOR_KINDS:
        raise ValueError(f"trainer.accelerator {accelerator!r} is unknown; valid: {', '.join(ACCELERATOR_KINDS)}")
    kind = ACCELERATOR_KINDS[accelerator]
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    xla: dict = {}
    store_file = None

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.accelerator 'gpu' was requested but torch sees no CUDA device")
        torch.cuda.set_device(local_rank)
        torch_device, hardware = torch.device("cuda", local_rank), _cuda_hardware(local_rank)
    elif kind == "xla":
        torch_device, hardware, xla = _xla_device()
    else:
        torch_device, hardware = torch.device("cpu"), "cpu"

    # NXDT_XLA_COLLECTIVES=gloo computes on the XLA device but communicates through gloo on host copies: the
    # only way several XLA:CPU processes can talk (PJRT's CPU client has no cross-process transport). Neuron
    # runs keep the xla backend.
    host_collectives = kind == "xla" and os.environ.get("NXDT_XLA_COLLECTIVES") == "gloo"
    backend = "gloo" if host_collectives else _BACKENDS[kind]
    if topology.is_joined():  # already in a group (a test harness, or a second init): keep it
        rank, world_size = topology.world()
    elif kind == "xla" and not host_collectives:
        # PJRT knows the ranks (from torchrun's environment when there is one); xla:// asks it.
        rank, world_size = topology.join_world(backend, init_method="xla://")
    elif "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        store = _attempt_store(rank, world_size)
        rank, world_size = topology.join_world(
            backend, init_method=None if store is not None else "env://", store=store, rank=rank,
            world_size=world_size, device_id=torch_device if kind == "cuda" else None)
    else:
        # A private file store: no port to collide with anything else on the machine.
        store_file = tempfile.NamedTemporaryFile(prefix="nxdt_pg_", delete=False).name
        rank, world_size = topology.join_world(backend, init_method=f"file://{store_file}", rank=0, world_size=1)
        local_rank = 0

    topology.use_host_staging(needs_host_staging)
    if rank != 0:
        # Every rank runs the same code and would print the same Python (and torch) warning: rank 0 says it once
        # per run. Errors are not warnings and still come from every rank.
        warnings.simplefilter("ignore")
    # The world the backend joined must be the one the launcher started: torch-xla's xla backend on a machine
    # whose PJRT client cannot reach the other processes reports a world of 1 in each, and its collectives then
    # return local values without an error (N independent copies training). Every rank checks and says so.
    started = _env_int("WORLD_SIZE", world_size)
    xla_world = xla["xr"].world_size() if kind == "xla" and not host_collectives else world_size
    if not (world_size == started == xla_world):
        topology.leave_world(drain=False)
        backend_world = f"torch-xla's runtime {xla_world}, " if xla_world != world_size else ""
        raise ValueError(
            f"the launch started {started} processes (WORLD_SIZE) but the {backend} backend joined a world of "
            f"{backend_world}{world_size}; on Neuron, launch with torchrun --nproc_per_node equal to "
            f"the NeuronCores to use (trainer.devices) on a host where torch-xla sees them")
    return Device(kind, torch_device, rank, world_size, local_rank, hardware, xla, store_file)


def needs_host_staging(tensor: torch.Tensor, backend: str) -> bool:
    """Whether a collective must go through host copies: gloo cannot address XLA tensors (the XLA:CPU tests run
    gloo over them); gloo with CPU tensors, nccl and xla address their own tensors."""
    return tensor.device.type not in ("cpu", "cuda") and backend == "gloo"


def flash_attention_kernels(tensor: torch.Tensor):
    """(forward, backward) flash-attention kernels that return and take the log-sum-exp, for tensors on this
    device, which ring attention calls block by block; None where it spells the math out instead (XLA compiles
    that; on CUDA a fused kernel is still to be wired in). The forward is the one SDPA runs in one process."""
    if tensor.device.type == "cpu":
        return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    return None


def shutdown(device: Device | None = None, *, drain: bool = True) -> None:
    """Leave the world; drain: wait for the process groups' threads (topology.leave_world says why), which a
    clean exit wants and an error path, with a collective perhaps still waiting on a dead peer, must not."""
    topology.leave_world(drain=drain)
    if device is not None and device._store_file:
        with contextlib.suppress(OSError):
            os.unlink(device._store_file)
