# Preflight: a collective smoke test a training job runs right after joining its process group. It takes
# seconds, and when a node or its link is broken it ends the job at once with one clear line, instead of the job
# hanging in its first gradient all-reduce until the backend's timeout (30 minutes and more) expires.
#
#   device = init_device(cfg.trainer.accelerator)
#   if cfg.trainer.preflight:                                  # training.trainer.preflight: true
#       preflight(device, timeout_s=cfg.trainer.preflight_timeout_s)
#
# Three steps, each bounded by timeout_s:
#   1. roll call: every rank writes its host name into the rendezvous store and waits for all the others; the
#      ranks that never arrive are named (PreflightError);
#   2. a tiny all_reduce of the rank numbers, checked against n(n-1)/2 (PreflightError when wrong);
#   3. an all_reduce of `nbytes`, timed: its busbw is printed by rank 0 and checked against min_busbw_gbps.
# A collective cannot be interrupted from Python, so while steps 2 and 3 run a watchdog thread waits: past
# timeout_s it prints what was stuck and where, and ends the process with PREFLIGHT_EXIT_CODE.
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

# Through the collectives module, as every collective of the runtime: it stages gloo over XLA tensors on host.
from runtime.parallel import topology
from runtime.parallel.collectives import all_reduce_world
from runtime.schema.facts import PREFLIGHT_EXIT_CODE  # noqa: F401 (train.py exits with it; the job script's decider reads it)

_KEY = "nxdt_preflight"
_ADVICE = "run `nxdt-launch cluster-validate` on these nodes to find the bad one"


class PreflightError(RuntimeError):
    """The process group is not fit to train on; the message is one line that says why."""


@dataclass(frozen=True)
class PreflightResult:
    world_size: int
    hosts: int
    seconds: float          # the whole preflight
    busbw_gbps: float       # of the timed all_reduce


def _roll_call(rank: int, world: int, timeout_s: float) -> int:
    """Number of distinct hosts; PreflightError naming the ranks that did not arrive in time."""
    store = topology.world_store()
    if store is None:  # a backend without one: skip the roll call
        return 0
    store.set(f"{_KEY}/{rank}", socket.gethostname())
    keys = [f"{_KEY}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - DistStoreError and friends: it timed out
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        raise PreflightError(f"preflight: rank(s) {shown} of {world} did not reach the preflight within "
                             f"{timeout_s:g}s (seen from rank {rank} on {socket.gethostname()}); {_ADVICE}") from None
    return len({store.get(key) for key in keys})


class _Watchdog:
    """Ends the process when the step it is guarding has not finished within the timeout."""

    def __init__(self, timeout_s: float, rank: int, world: int, exit=os._exit):
        self.timeout_s, self.rank, self.world, self._exit = timeout_s, rank, world, exit
        self.step = "starting"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nxdt-preflight-watchdog", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def _watch(self) -> None:
        if not self._done.wait(self.timeout_s):
            print(f"error: preflight: {self.step} over {self.world} ranks did not complete within "
                  f"{self.timeout_s:g}s on rank {self.rank} ({socket.gethostname()}): a node or its network link "
                  f"is down or far too slow; {_ADVICE}", file=sys.stderr, flush=True)
            self._exit(PREFLIGHT_EXIT_CODE)

    def __exit__(self, *exc) -> None:
        self._done.set()


def preflight(device=None, *, timeout_s: float = 60.0, nbytes: int = 8 << 20, iters: int = 5,
              min_busbw_gbps: float | None = None, log=print, exit=os._exit,
              results_dir: str | None = None) -> PreflightResult:
    """Check the default process group. `device` is runtime.device.Device (or None for CPU tensors). With the
    run's `results_dir`, a node that an injected fault makes unhealthy (runtime/schema/faults.py) fails here first."""
    started = time.perf_counter()
    rank, world = topology.world()
    if results_dir is not None:
        from runtime.fault_tolerance.node_check import injected_unhealthy
        from runtime.fault_tolerance.watchdog import node_name

        why = injected_unhealthy(node_name(), results_dir)
        if why:
            raise PreflightError(f"preflight: node {node_name()} (rank {rank}) failed its health check ({why}); "
                                 f"{_ADVICE}")
    torch_device = getattr(device, "torch_device", torch.device("cpu"))

    def finish() -> None:  # lazy (XLA) devices run queued work only at a step boundary
        if device is not None:
            device.step_boundary()
            device.synchronize()

    hosts = _roll_call(rank, world, timeout_s)
    with _Watchdog(timeout_s, rank, world, exit) as watchdog:
        watchdog.step = "an all_reduce of the rank numbers"
        ranks = torch.tensor([float(rank)], device=torch_device)
        all_reduce_world(ranks)
        finish()
        if int(ranks.item()) != world * (world - 1) // 2:
            raise PreflightError(f"preflight: all_reduce of the rank numbers gave {ranks.item():g} on rank {rank}, "
                                 f"expected {world * (world - 1) // 2}: the collective library returns wrong data")

        watchdog.step = f"a {nbytes / 2**20:g} MiB all_reduce"
        buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=torch_device)
        all_reduce_world(buffer)  # warm-up: connections and algorithm choice are made here
        finish()
        t0 = time.perf_counter()
        for _ in range(iters):
            all_reduce_world(buffer)
            if device is not None:
                device.step_boundary()
        finish()
        seconds = (time.perf_counter() - t0) / iters
    busbw = buffer.numel() * 4 / seconds / 1e9 * (2 * (world - 1) / world) if world > 1 else 0.0
    if min_busbw_gbps is not None and world > 1 and busbw < min_busbw_gbps:
        raise PreflightError(f"preflight: all_reduce busbw {busbw:.3g} GB/s on rank {rank} is below "
                             f"{min_busbw_gbps:g} GB/s; {_ADVICE}")
    result = PreflightResult(world, hosts, time.perf_counter() - started, busbw)
    if rank == 0:
        log(f"preflight: {world} ranks on {hosts or '?'} host(s) ok; {nbytes / 2**20:g} MiB all_reduce busbw "
            f"{busbw:.3g} GB/s; {result.seconds:.2f}s", flush=True)
    return result
