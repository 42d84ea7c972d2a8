"""Peak memory of real training runs on CPU, as torch's allocator sees it: run with `python measure_memory.py
CONFIG...` (resolved training-stage YAMLs, world size 1, trainer.max_steps >= 2); prints one JSON line per config.

What is measured: the runtime's own `train()` (the function `python -m runtime.train` runs) under torch's profiler
with memory profiling, which records every CPU tensor allocation and free. Replaying those events gives the bytes
of live tensors at every moment; the peak is taken over training steps 2 and later (step 1 may still be building
lazily allocated state; every later step starts with all of it and repeats the same allocations). That is the
quantity the estimator predicts. The process's resident set (what metrics.jsonl reports as memory_gib) is larger
by the Python + torch baseline and allocator caching, so it is reported beside it but not compared.

Where the time goes: almost all of it is the training steps themselves, in the bf16 cases above all (a CPU
without AVX-512 has no fast bf16 matmul: ~45x the time of an fp32 one on a 2-core AMD EPYC), not the profiler's
bookkeeping; hence the test's 2 steps, the fewest that include a step 2.
"""
from __future__ import annotations

import gc
import json
import resource
import sys
import time

import torch
from torch.autograd.profiler import profile, record_function

import runtime.train as train_module
from runtime.config import load_training_config
from runtime.device import init_device, shutdown

STEP_MARK = "nxdt_measured_step"


def peak_live_bytes(events, first_step: int = 2) -> int:
    """Replay the profiler's [memory] events in time order; the largest total during the marked steps."""
    steps = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == STEP_MARK)
    windows = steps[first_step - 1:]
    if not windows:
        raise ValueError(f"the peak is taken over steps {first_step} and later, but only {len(steps)} step(s) ran: "
                         f"raise trainer.max_steps to at least {first_step}")
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for when, nbytes in allocations:
        live += nbytes
        if any(start <= when <= end for start, end in windows):
            peak = max(peak, live)
    return peak


def profiled_train(cfg, device):
    """Run the runtime's own train() under the memory profiler, each train_step marked; (events, seconds)."""
    original = train_module.train_step

    def marked_step(*args, **kwargs):
        with record_function(STEP_MARK):
            return original(*args, **kwargs)

    train_module.train_step = marked_step
    # A previous run's model and optimizer can outlive its train() in reference cycles; if the garbage collector
    # freed them during this profile, their frees would be subtracted from this run's live bytes (it happened:
    # the third of five cases read 34 MiB instead of 44 MiB). So they go first.
    gc.collect()
    started = time.perf_counter()
    try:
        # torch.profiler.profile is this same Kineto profiler behind a scheduler; its start also imports
        # torch._inductor (~1.7 s of CPU) only to read a CUDA-graphs setting, so the backend is used directly.
        with profile(use_kineto=True, profile_memory=True) as prof:
            train_module.train(cfg, device)
    finally:
        train_module.train_step = original
    return prof.kineto_results.events(), time.perf_counter() - started


def measure(path: str, device) -> dict:
    events, seconds = profiled_train(load_training_config(path), device)
    return {"config": path, "peak_bytes": peak_live_bytes(events), "seconds": seconds,
            "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)  # steadier on a shared 2-core machine; memory does not depend on it
    device = init_device("cpu")
    try:
        for path in paths:
            print(json.dumps(measure(path, device)), flush=True)
    finally:
        shutdown(device)


if __name__ == "__main__":
    main(sys.argv[1:])
