"""Per-rank peak memory and step time of ZeRO-1, ZeRO-2, ZeRO-3 (runtime/parallel/zero3.py), hybrid ZeRO-3 (shard
degree 2: two pairs of ranks, each pair holding a replica) and torch's FSDP2 (`fully_shard`, per block and at the
root) on one Llama, 4 ranks on CPU (gloo), fp32, AdamW.

Every mode builds the model on the meta device, as runtime/train.py does at recipe sizes: ours through
parallelize_model (at tp 1 a rank materializes the whole model once, bucket by bucket copied into the flat buffers
and, at ZeRO-3, cut to its shard), FSDP2 by fully_shard on the meta model, then to_empty and an init of its local
shards. Each rank is its own process; the parent samples every worker's VmHWM (the kernel's peak RSS) from /proc,
from outside, and reports the largest. "fixed" is the same process without this model but after two steps of
ZeRO-3 and of FSDP2 on a tiny one (torch, gloo, the groups, and the code and buffers a first step maps for good):
the part of every figure that is not the model. Every block is activation-checkpointed unless --checkpoint '' (the
bound below has no activation term). Step time: one warm-up step, then the median of the rest. The issue's bound:
    peak <= (own shard of params + grads + AdamW's two moments) x 1.25 + largest gathered unit + fixed
(what a rank keeps whole is counted whole: ZeRO-1 keeps params and grads, ZeRO-2 the params).

    PYTHONPATH=$PWD python3 benchmarks/zero3.py [--hidden 768 --layers 12 --steps 4 ...]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

# glibc's mmap threshold for every worker (unless the environment sets one): by default it rises to 32 MB after the
# first large frees, so later tensors come from the heap and freed ones stay in the process; RSS then measures the
# allocator's retention, not what a mode holds (at 87M ZeRO-3 read 1.62 GiB without it, 0.87 GiB with it).
MMAP_THRESHOLD = 65536
# mode: (ZeRO stage, shard degree); fsdp2 and fixed are not ours
MODES = {"fixed": None, "zero1": (1, None), "zero2": (2, None), "zero3": (3, None), "hybrid": (3, 2), "fsdp2": None}


def _config(args):
    from runtime.models import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_attention_heads=args.heads, num_query_groups=args.heads // 4, ffn_hidden_size=args.ffn,
                       max_position_embeddings=args.seq, rotary_base=10000.0)


def _batch(args, rank: int, step: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _fsdp2(args, world: int):
    """FSDP2 built as it is at scale: fully_shard on the meta model, then each rank's shards allocated and drawn."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from runtime.models import meta_model
    from runtime.parallel.parallelize import checkpoint_module
    model = meta_model(_config(args))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        if args.checkpoint == "full":
            checkpoint_module(block)  # what parallelize_model does for ours
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local()
            local.fill_(1.0) if param.dim() == 1 else local.normal_(0.0, 0.02)  # norm weights 1, matrices drawn
        for module in model.modules():
            if list(module.buffers(recurse=False)) and not list(module.parameters(recurse=False)):
                module.reset_parameters()  # the rotary tables
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(inputs, labels):
        loss = model(inputs, labels)
        (loss if loss.dim() == 0 else loss.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _ours(args, world: int, stage: int, degree: int | None):
    import torch
    from runtime.device import flash_attention_kernels
    from runtime.models import meta_model
    from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
    from runtime.step import train_step
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=world, world_size=world), degree)
    model = parallelize_model(meta_model(_config(args)), topo, attention_kernels=flash_attention_kernels,
                              activation_checkpointing=args.checkpoint or None, data_parallel=DataParallelConfig("fp32", zero_stage=stage))
    optimizer = ShardedAdamW(model, {"lr": 1e-4})

    def step(inputs, labels):
        mask = torch.ones_like(labels, dtype=torch.float32)
        train_step(model, optimizer, [(inputs, labels, mask)], topo, lr=1e-4, clip=1.0)
    step.model, step.optimizer = model, optimizer
    return step


def _self_hwm() -> int:
    return _hwm(os.getpid())


def _memory() -> dict:
    """This process now: peak RSS, RSS, and the bytes of every tensor storage Python can reach (each once)."""
    import gc
    import torch
    storages = {}
    for obj in gc.get_objects():
        try:  # DTensors and other wrappers have no storage of their own: their local tensors are counted
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:
            pass
    return {"hwm": _self_hwm(), "rss": _rss(), "tensors": sum(storages.values())}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(model, optimizer) -> list[tuple]:
    """Installs recorders on one ZeRO-3 rank: at every unit hook and every reduction start / finish, (event, VmRSS,
    gathered parameter bytes, open full-gradient bytes, reductions in flight, live saved-activation bytes).
    Returns the list the next step fills."""
    import torch
    dp, events = model.data_parallel, []
    zero3, saved = dp.zero3, {}

    def record(name):
        gathered = sum(b.param_buffer.untyped_storage().nbytes() for b in zero3.managed)
        grads = sum(b.grad_buffer.nbytes for b in dp.buckets if b.grad_buffer is not None)
        peak = _self_hwm()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the kernel's peak RSS starts again from the current RSS: each event's peak is its own
        events.append((name, _rss(), peak, gathered, grads, len(dp._pending), sum(saved.values())))

    def wrap(owner, attr, label):
        inner = getattr(owner, attr)

        def call(*args, **kwargs):
            out = inner(*args, **kwargs)
            which = "" if not args else args[0] if isinstance(args[0], int) else next(
                (i for i, u in enumerate(zero3.units) if u is args[0]), "")
            record(f"{label} {which}")
            return out
        setattr(owner, attr, call)
    for attr, label in (("_before_forward", "fwd pre"), ("_after_forward", "fwd post"),
                        ("_before_backward", "bwd pre"), ("_release", "free")):
        wrap(zero3, attr, label)
    wrap(dp, "_start", "reduce start")
    wrap(dp, "_finish", "reduce done")
    for owner, attr in ((dp, "reduce_gradients"), (optimizer, "clip_grad_norm"), (optimizer, "step")):
        wrap(owner, attr, attr)

    def pack(t):
        storage = t.untyped_storage()  # a weight's storage moves each gather: compared at the time
        if storage.nbytes() and storage.data_ptr() not in {b.param_buffer.untyped_storage().data_ptr()
                                                           for b in dp.buckets}:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    model.register_forward_pre_hook(lambda *_: saved.clear() or record("step begins"))
    record("between steps")
    return events, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    # What every mode loads, imported by each (the fixed part too): the runtime and FSDP2's DTensor machinery.
    import torch.distributed.fsdp  # noqa: F401
    import runtime.parallel  # noqa: F401
    import runtime.step  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"mode": args.mode}
    if args.mode == "fixed":
        # No model of this size, but everything a mode's step loads: the process groups (hybrid's sub-groups and a
        # mesh), and two steps of ZeRO-3 and of FSDP2 on a tiny Llama. The first step maps code and runtime
        # buffers that stay (at 87M a ZeRO-3 rank held 135 MiB more RSS after it than its tensors: libtriton.so
        # alone 71 MiB, more of libtorch_cpu.so, the allocator's and the libraries' own buffers).
        from runtime.parallel import ParallelDims, Topology
        Topology.build(ParallelDims(tp=1, pp=1, dp=world, world_size=world), 2)
        tiny = argparse.Namespace(**{**vars(args), "hidden": 64, "layers": 2, "heads": 4, "ffn": 128, "vocab": 256})
        for step in (_ours(tiny, world, 3, None), _fsdp2(tiny, world)):
            for index in range(2):
                step(*_batch(tiny, rank, index))
    else:
        step = _fsdp2(args, world) if args.mode == "fsdp2" else _ours(args, world, *MODES[args.mode])
        times, events, out["after"] = [], None, {"build": _memory()}
        for index in range(args.steps):
            dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's
            started = time.perf_counter()
            with hooks if events is not None else contextlib.nullcontext():
                step(*_batch(args, rank, index))
            times.append(time.perf_counter() - started)
            out["after"][f"step {index + 1}"] = _memory()
            if args.probe and index == 0:
                events, hooks = probe(step.model, step.optimizer)
        if events:
            out["events"] = events
        out["step_s"] = statistics.median(times[1:])  # the first step warms up (allocator, first gathers)
    dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_mode(args, mode: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), **os.environ, "RANK": str(rank),
               "WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", "--mode", mode] + args.passthrough
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    peaks = [0] * args.world
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            peaks[i] = max(peaks[i], _hwm(p.pid))
        time.sleep(0.05)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode}: a worker failed (exit codes {[p.returncode for p in procs]})")
    lines = procs[0].stdout.read().splitlines()
    result = next(json.loads(line[7:]) for line in lines if line.startswith("RESULT "))
    result["peak_rss"] = max(peaks)
    return result


def sizes(args) -> tuple[int, int]:
    """(parameters, the largest ZeRO-3 unit's parameters), from the meta model."""
    from runtime.models import meta_model
    from runtime.parallel.zero3 import find_units
    model = meta_model(_config(args))
    units = find_units(model)
    return sum(p.numel() for p in model.parameters()), max(sum(p.numel() for p in ps) for _, ps in units)


def bound(mode: str, params: int, unit: int, fixed: int, world: int) -> float:
    """(own shard of params + grads + 2 moments) x 1.25 + the largest gathered unit + fixed, in bytes (fp32)."""
    shard = {"zero1": (1, 1, world), "zero2": (1, world, world), "zero3": (world, world, world),
             "hybrid": (2, 2, 2), "fsdp2": (world, world, world)}[mode]
    own = params * 4 * (1 / shard[0] + 1 / shard[1] + 2 / shard[2])
    return own * 1.25 + 4 * unit + fixed


def print_probe(events: list) -> None:
    """The probe's events: RSS, and the peak since the event before, in MiB over the RSS between steps."""
    base, mib = events[0][1], 2 ** 20
    print(f"RSS between steps {base / mib:.0f} MiB")
    print("| event | RSS | peak since the last | gathered params | full grad buffers | reductions in flight | saved |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rss, peak, gathered, grads, pending, saved in events:
        print(f"| {name} | {(rss - base) / mib:.0f} | {(peak - base) / mib:.0f} | {gathered / mib:.0f} | "
              f"{grads / mib:.0f} | {pending} | {saved / mib:.0f} |")
    print(f"peak over between steps: {(max(e[2] for e in events) - base) / mib:.0f} MiB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    for key, default in (("hidden", 768), ("layers", 12), ("heads", 12), ("ffn", 2048), ("vocab", 8192),
                         ("seq", 128), ("micro", 1), ("steps", 4), ("world", 4)):
        parser.add_argument(f"--{key}", type=int, default=default)
    parser.add_argument("--checkpoint", default="full", choices=("full", ""),
                        help="activation checkpointing of every block ('': none)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--probe", action="store_true", help="one ZeRO-3 rank's memory at every hook of step 2")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.passthrough = [a for k, v in vars(args).items() if k not in ("worker", "mode", "modes", "probe")
                        for a in (f"--{k}", str(v))] + (["--probe"] if args.probe else [])
    began = time.perf_counter()
    if args.probe:
        print_probe(run_mode(args, "zero3")["events"])
        return 0
    results = {mode: run_mode(args, mode) for mode in args.modes.split(",")}
    params, unit = sizes(args)
    fixed, gib = results["fixed"]["peak_rss"], 2 ** 30
    fsdp2 = results.get("fsdp2", {}).get("step_s")
    print(f"Llama {params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"largest unit {unit / 1e6:.1f}M, {args.world} ranks, fixed part {fixed / gib:.2f} GiB")
    print("| mode | peak RSS GiB | bound GiB | holds | step s | step / FSDP2 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        if mode == "fixed":
            continue
        limit = bound(mode, params, unit, fixed, args.world)
        r.update(bound=limit, holds=r["peak_rss"] <= limit)
        ratio = f"{r['step_s'] / fsdp2:.2f}" if fsdp2 else "-"
        print(f"| {mode} | {r['peak_rss'] / gib:.2f} | {limit / gib:.2f} | {'yes' if r['holds'] else 'no'} | "
              f"{r['step_s']:.2f} | {ratio} |")
    print(f"wall time {time.perf_counter() - began:.0f} s")
    print(json.dumps({m: {k: v for k, v in r.items() if k != "mode"} for m, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
