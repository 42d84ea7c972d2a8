# The worker's half of hang detection: each rank says which section it is in (setup, data, step, validation,
# checkpoint) and since when, in one small file its node's watchdog reads (watchdog.py). A section change is one
# pwrite of a fixed-size record into a file on node-local memory (NXDT_HEARTBEAT_DIR, under /dev/shm): no device
# read, no collective, nothing on XLA's graph. The record also carries the slowest recent duration of each
# section this process has finished, from which the watchdog learns the step timeout; a section that has not
# finished once in this process (it may be compiling its graph) is timed by the setup timeout.
#
# SIGUSR2 makes the worker write its Python stack (faulthandler, which works while the main thread is blocked in
# C): the watchdog asks a stalled rank for it, to tell a rank waiting in a collective from the one it waits for.
#
# The injected fault (runtime/schema/faults.py) is checked here, at section changes, and only when one is set.
from __future__ import annotations

import collections
import faulthandler
import json
import os
import signal
import socket
import sys
import time

from runtime.schema import faults

RECORD_BYTES = 512
DIR_ENV = "NXDT_HEARTBEAT_DIR"
STACK_SIGNAL = signal.SIGUSR2
_RECENT = 20  # the step timeout follows the slowest of this many recent durations


def record_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"rank{local_rank}.json")


def stack_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"rank{local_rank}.stack")


class Progress:
    """Opened once per worker by `from_env`; `enter(section, step)` at each section change."""

    def __init__(self, rank: int, local_rank: int, directory: str | None, fault: faults.Fault | None,
                 fired_marker: str | None):
        self.rank, self.local_rank = rank, local_rank
        self._fault, self._marker = fault, fired_marker
        self._fd = None
        self._section, self._step, self._since = "setup", 0, time.time()
        self._slowest: dict[str, collections.deque] = {}
        if directory:
            self._fd = os.open(record_path(directory, local_rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._stack = open(stack_path(directory, local_rank), "w")
            faulthandler.register(STACK_SIGNAL, file=self._stack, all_threads=True)
            self._write()

    @classmethod
    def from_env(cls, results_dir: str) -> "Progress | None":
        """None when there is neither a watchdog nor a fault to inject: the step loop then checks nothing."""
        directory = os.environ.get(DIR_ENV) or None
        fault, problem = faults.parse(os.environ.get(faults.ENV, ""))
        if problem:
            raise ValueError(problem)
        if fault is not None and fault.kind == "unhealthy":
            fault = None  # the health checks read that one (runtime/preflight.py, node_check.py)
        if directory is None and fault is None:
            return None
        rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
        return cls(rank, local_rank, directory, fault, os.path.join(results_dir, faults.FIRED))

    def enter(self, section: str, step: int) -> None:
        now = time.time()
        if self._section != "setup":
            recent = self._slowest.setdefault(self._section, collections.deque(maxlen=_RECENT))
            recent.append(now - self._since)
        self._section, self._step, self._since = section, step, now
        if self._fd is not None:
            self._write()
        fault = self._fault
        if fault is not None and fault.step == step and fault.section == section and (
                fault.rank == self.rank if fault.kind != "lost" else fault.node == node_name()):
            self._fire()

    def close(self, why: str = "shutdown") -> None:
        """Leaving: the process group's teardown is still timed (by the checkpoint timeout: a hung teardown would
        otherwise hold the job to its time limit). `why` is "peer_lost" for a rank that stops because another one
        did: the job script then looks for the cause elsewhere. Idempotent."""
        if self._fd is None:
            return
        self._section, self._since = why, time.time()
        self._write()
        os.close(self._fd)
        self._fd = None
        faulthandler.unregister(STACK_SIGNAL)
        signal.signal(STACK_SIGNAL, signal.SIG_IGN)  # a watchdog's late ask must not end the process
        self._stack.close()

    def _write(self) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "section": self._section, "step": self._step,
                  "since": self._since, "slowest": {k: max(v) for k, v in self._slowest.items()}}
        os.pwrite(self._fd, json.dumps(record).encode().ljust(RECORD_BYTES), 0)

    def _fire(self) -> None:
        fault, self._fault = self._fault, None
        if fault.kind == "lost":
            return _lose_node(fault, self._marker, self.rank)
        if claim_fault(self._marker) is not None:  # fired already, by another worker or an earlier attempt
            return
        say = f"nxdt: injected fault ({faults.ENV}={fault}): rank {self.rank} "
        if fault.kind == "exit":
            sys.stderr.write(say + f"exits with 1 as {fault.section} {fault.step} begins\n")
            sys.stderr.flush()
            os._exit(1)
        if fault.kind == "sleep":
            sys.stderr.write(say + f"sleeps {fault.seconds:g} s in {fault.section} {fault.step}\n")
            sys.stderr.flush()
            time.sleep(fault.seconds)
            return
        sys.stderr.write(say + f"stops making progress in {fault.section} {fault.step}\n")
        sys.stderr.flush()
        while True:
            time.sleep(3600)


def node_name() -> str:
    """This node's name as Slurm knows it (the hostname elsewhere): what reports, stores and faults name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def allocation_tag() -> str:
    """This allocation (job id and requeue count): what an injected bad node's marker holds."""
    return f"{os.environ.get('SLURM_JOB_ID', '')}:{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def _lose_node(fault: faults.Fault, marker: str, rank: int) -> None:
    """lost:node=NAME:step=S: every worker of that node ends as a node's loss ends it, with no word to anyone:
    the node's peer store, this worker's torchrun and the worker itself killed. Once per run; the marker names
    this allocation, whose node checks then fail on NAME (node_check.injected_unhealthy)."""
    first = claim_fault(marker, allocation_tag())
    if first is not None and first != allocation_tag():
        return  # fired in an earlier allocation
    sys.stderr.write(f"nxdt: injected fault ({faults.ENV}={fault}): rank {rank} on {fault.node}: the node is lost "
                     f"as step {fault.step}'s save begins\n")
    sys.stderr.flush()
    registry = os.environ.get("NXDT_PEER_REGISTRY")
    entry = os.path.join(registry, f"{fault.node}.json") if registry else None
    try:
        with open(entry) as f:
            os.kill(int(json.load(f)["pid"]), signal.SIGKILL)
    except (TypeError, OSError, ValueError, KeyError):
        pass  # no peer store on this node
    os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun: it reports nothing
    os.kill(os.getpid(), signal.SIGKILL)


def claim_fault(marker: str, holder: str = "") -> str | None:
    """The injected fault fires once per run: create `marker` (<results_dir>/.nxdt_fault_fired) holding `holder`.
    None when this call created it; else what the first claimant wrote (a restarted run finds it there)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            with open(marker) as f:
                return f.read().strip()
        except OSError:
            return ""
    with os.fdopen(fd, "w") as f:
        f.write(holder)
    return None


def read_record(path: str) -> dict | None:
    """A worker's last record, or None before its first (or on a torn read, which the next poll retries)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(RECORD_BYTES).decode().strip() or "null")
    except (OSError, ValueError):
        return None
