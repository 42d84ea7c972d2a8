"""Run a function in N real torch.distributed processes on this machine (gloo, CPU) and collect what each returns.

Reusable from any test directory:

    from tests.runtime_parallel.dist_utils import run_distributed
    results = run_distributed(my_module_level_fn, world_size=2, args=(cfg,))   # [rank0 result, rank1 result]

`fn(*args)` runs after dist.init_process_group in every process, so it can build groups and use collectives;
it must be defined at module level (spawned processes import it by name). The rendezvous is a file in a fresh
temporary directory, so concurrent test runs never fight over a TCP port. An exception in any rank fails the
call with that rank's traceback; a rank still running after `deadline_s` is killed, a failure and not a hang.

The ranks are forked from the test process, where torch and the runtime are already imported, instead of spawned
as fresh interpreters that import them again (3-4 s of CPU each on the CI machine). The worker's first act, one
intra-op thread, is what makes the fork safe: the parent's OpenMP threads do not survive it, and a child that
asked for more would wait on them forever. They are spawned when the test process holds process groups of its
own (a fork would inherit them), or when the test asks (start_method="spawn": what a fresh interpreter does at
its exit is under test; a forked rank leaves with os._exit).
"""
from __future__ import annotations

import gc
import importlib
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                    backend: str = "gloo", timeout_s: float = 180.0, start_method: str = "fork",
                    deadline_s: float = 300.0) -> list[Any]:
    from runtime.parallel import topology

    if dist.is_initialized() or any(ref() is not None for ref in topology._groups):
        start_method = "spawn"
    if start_method == "fork":
        # What torch imports lazily in every rank otherwise: the first backward given its gradients (a pipeline
        # stage's) imports sympy, a second of CPU per forked rank; imported here, once per test process.
        importlib.import_module("torch.fx.experimental.symbolic_shapes")  # `import torch.fx...` would bind a local
    with tempfile.TemporaryDirectory(prefix="nxdt_dist_") as tmp:
        # The test process's objects, frozen while the ranks fork: a rank's garbage collections (leave_world's
        # among them) then skip them rather than walk, and copy, the whole inherited heap (most of a CPU second).
        gc.freeze()
        try:
            context = mp.start_processes(_worker, args=(world_size, backend, tmp, fn, tuple(args), timeout_s),
                                         nprocs=world_size, join=False, start_method=start_method)
        finally:
            gc.unfreeze()
        deadline = time.monotonic() + deadline_s
        while not context.join(timeout=0.5):  # raises with the traceback of a rank that failed
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks in {deadline_s:.0f} s")
        return [torch.load(os.path.join(tmp, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]


def _worker(rank: int, world_size: int, backend: str, tmp: str, fn, args, timeout_s: float) -> None:
    # One intra-op thread per process: the ranks share the machine's cores, and oversubscription only slows
    # every rank down (and makes collectives wait on the slowest).
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import datetime

    from runtime.parallel.topology import backend_threads, join_world, leave_world
    join_world(backend, init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=rank, world_size=world_size,
               timeout=datetime.timedelta(seconds=timeout_s))
    clean = False
    try:
        result = fn(*args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        clean = True
    finally:
        # As the runtime leaves (see leave_world): without the drain, a gloo worker can still be dropping a
        # collective's tensors when the interpreter finalizes, and the rank aborts after passing.
        held = leave_world(drain=clean)
    assert held == 0, f"{held} process groups are still referenced after the run: their threads outlive it"
    assert not backend_threads(), f"gloo threads outlive leave_world: {backend_threads()}"
