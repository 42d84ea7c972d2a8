"""Per-rank peak memory and step time of ZeRO-1, ZeRO-2, ZeRO-3 (runtime/parallel/zero3.py) and torch's FSDP2
(`fully_shard`, per block and at the root) on one Llama, 4 ranks on CPU (gloo), fp32, AdamW.

Each rank is its own process; the parent samples every worker's VmHWM (the kernel's peak RSS) from /proc, from
outside, and reports the largest. "fixed" is the same process with no model (torch, gloo, the world joined): the
part of every figure that is not the model. The issue's bound for ZeRO-3:
    peak <= (own shard of params + grads + AdamW's two moments) x 1.25 + largest gathered block + fixed.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 benchmarks/zero3.py [--hidden 1024 --layers 12 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

MODES = ("fixed", "zero1", "zero2", "zero3", "fsdp2")


def _config(args):
    from runtime.models import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_attention_heads=args.heads, num_query_groups=args.heads // 4, ffn_hidden_size=args.ffn,
                       max_position_embeddings=args.seq, rotary_base=10000.0)


def _batches(args, rank: int, step: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"mode": args.mode}
    if args.mode != "fixed":
        from runtime.models import build_model
        cfg = _config(args)
        times = []
        if args.mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            model = build_model(cfg)
            mesh = init_device_mesh("cpu", (world,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for step in range(args.steps):
                started = time.perf_counter()
                inputs, labels = _batches(args, rank, step)
                loss = model(inputs, labels)
                loss = loss if loss.dim() == 0 else loss.mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - started)
        else:
            from runtime.device import flash_attention_kernels
            from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
            from runtime.step import train_step
            topo = Topology.build(ParallelDims(tp=1, pp=1, dp=world, world_size=world))
            stage = int(args.mode[-1])
            model = parallelize_model(build_model(cfg), topo, attention_kernels=flash_attention_kernels,
                                      data_parallel=DataParallelConfig("fp32", zero_stage=stage))
            optimizer = ShardedAdamW(model, {"lr": 1e-4})
            for step in range(args.steps):
                started = time.perf_counter()
                inputs, labels = _batches(args, rank, step)
                mask = torch.ones_like(labels, dtype=torch.float32)
                train_step(model, optimizer, [(inputs, labels, mask)], topo, lr=1e-4, clip=1.0)
                times.append(time.perf_counter() - started)
        out["step_s"] = min(times[1:]) if len(times) > 1 else times[0]
        block = sum(p.numel() for p in build_model(_config(argparse.Namespace(**{**vars(args), "layers": 1})))
                    .layers[0].parameters())
        out.update(params=sum(p.numel() for p in build_model(cfg).parameters()) if rank == 0 else None,
                   block=block)
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
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", "--mode", mode] + args.passthrough
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    peaks = [0] * args.world
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            peaks[i] = max(peaks[i], _hwm(p.pid))
        time.sleep(0.05)
    lines = procs[0].stdout.read().splitlines()
    result = next(json.loads(line[7:]) for line in lines if line.startswith("RESULT "))
    result["peak_rss"] = max(peaks)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    for key, default in (("hidden", 768), ("layers", 12), ("heads", 12), ("ffn", 2048), ("vocab", 8192),
                         ("seq", 128), ("micro", 1), ("steps", 3), ("world", 4)):
        parser.add_argument(f"--{key}", type=int, default=default)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.passthrough = [a for k, v in vars(args).items() if k not in ("worker", "mode") for a in (f"--{k}", str(v))]
    results = {mode: run_mode(args, mode) for mode in MODES}
    fixed, gib = results["fixed"]["peak_rss"], 2 ** 30
    params, block, world = results["zero3"]["params"], results["zero3"]["block"], args.world
    bound = 4 * params / world * 4 * 1.25 + 4 * block + fixed  # (params + grads + 2 moments) / world, fp32
    for mode, r in results.items():
        print(f"{mode:6s} peak RSS {r['peak_rss'] / gib:6.2f} GiB" +
              (f"  step {r['step_s']:6.2f} s" if "step_s" in r else ""))
    print(f"model {params / 1e6:.0f}M params, largest block {block / 1e6:.1f}M; ZeRO-3 bound "
          f"{bound / gib:.2f} GiB: {'holds' if results['zero3']['peak_rss'] <= bound else 'exceeded'}; "
          f"step time ZeRO-3 / FSDP2 = {results['zero3']['step_s'] / results['fsdp2']['step_s']:.2f}")
    print(json.dumps({m: {k: v for k, v in r.items() if k != "mode"} for m, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
