"""Checkpoint save, async stall and load for a >= 300M-parameter GPT (fp32, AdamW state), one process on CPU.

Ours (runtime/checkpoint) side by side with two references in the same run:
  torch.save       model.state_dict() and the Adam moments in one file, then fsync (what a hand-written
                   trainer does), and torch.load back
  DCP              torch.distributed.checkpoint.save / load of the same state dict (the library the issue
                   names; single process)
Every writer fsyncs its files, so the numbers are the disk's, not the page cache's.

The async figure is the stall: from the save() call until its write has finished, how much longer the training
steps that ran took than as many plain steps (median of `--repeats`).

    python benchmarks/checkpoint.py [--layers 24 --hidden 1024] [--dir /tmp/nxdt-ckpt-bench]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.checkpoint import Checkpointer, load_checkpoint, resolve_checkpoint  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model  # noqa: E402
from runtime.step import train_step  # noqa: E402


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())


def _setup(args):
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{args.dir}/.pg", rank=0, world_size=1)
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    cfg = ModelConfig(architecture="gpt", vocab_size=32768, hidden_size=args.hidden, num_layers=args.layers,
                      num_attention_heads=args.hidden // 64, ffn_hidden_size=4 * args.hidden,
                      max_position_embeddings=args.seq, share_embeddings_and_output_weights=True)
    model = parallelize_model(build_model(cfg), topo, sequence_parallel=False, data_parallel=DataParallelConfig())
    optimizer = ShardedAdamW(model, {"lr": 1e-4})
    return cfg, topo, model, optimizer


def _batch(cfg, args, step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=gen)
    return [(ids[:, :-1], ids[:, 1:], None)]


def _state(model, optimizer) -> dict:
    return {"model": model.state_dict(),
            "optim": {i: {"exp_avg": m, "exp_avg_sq": v}
                      for i, (m, v) in enumerate(zip(optimizer.exp_avg, optimizer.exp_avg_sq))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/nxdt-ckpt-bench")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg, topo, model, optimizer = _setup(args)
    params = sum(p.numel() for p in model.data_parallel.params)
    step = lambda i: train_step(model, optimizer, _batch(cfg, args, i), topo, lr=1e-4, clip=1.0)  # noqa: E731
    for i in range(2):
        step(i)
    state_bytes = sum(t.numel() * t.element_size() for t in (
        [b.param_buffer for b in model.data_parallel.buckets] + optimizer.exp_avg + optimizer.exp_avg_sq))
    print(f"model: {params / 1e6:.0f}M parameters; weights + Adam moments {state_bytes / 2**30:.2f} GiB; "
          f"{torch.get_num_threads()} threads")

    # One Checkpointer for ours, as in training: its host staging buffers are allocated at the first save and
    # reused after (the first save also pays for mapping them; it is reported separately).
    ours = Checkpointer(root / "ours", rank=0, world_size=1, token="0", async_save=False, keep_last=1)
    started = time.perf_counter()
    ours.save(1, model, optimizer, topo, extra={"step": 1}, config={})
    first_save = time.perf_counter() - started
    import torch.distributed.checkpoint as dcp

    copies = []

    def save_ours(r):
        ours.save(2 + r, model, optimizer, topo, extra={"step": 2 + r}, config={})
        copies.append(ours.last_timings["snapshot_s"])  # the copy into the (warm) host staging buffers

    def load_ours(r):
        storage, committed = resolve_checkpoint(str(root / "ours"))
        load_checkpoint(storage, committed, model, optimizer, topo, rank=0)

    def save_torch(r):
        with open(root / "torch.pt", "wb") as f:
            torch.save(_state(model, optimizer), f)
            f.flush()
            os.fsync(f.fileno())

    def load_torch(r):
        loaded = torch.load(root / "torch.pt", weights_only=True)
        model.load_state_dict(loaded["model"])
        for i, (m, v) in enumerate(zip(optimizer.exp_avg, optimizer.exp_avg_sq)):
            m.copy_(loaded["optim"][i]["exp_avg"])
            v.copy_(loaded["optim"][i]["exp_avg_sq"])

    def save_dcp(r):
        shutil.rmtree(root / "dcp", ignore_errors=True)
        dcp.save(_state(model, optimizer), checkpoint_id=str(root / "dcp"))
        _fsync_tree(root / "dcp")

    def load_dcp(r):
        dcp.load(_state(model, optimizer), checkpoint_id=str(root / "dcp"))

    writers = {"ours": (save_ours, load_ours), "torch.save": (save_torch, load_torch), "DCP": (save_dcp, load_dcp)}
    times = {name: ([], []) for name in writers}
    for r in range(args.repeats):
        # Rotate the order, and flush earlier writes first, so no writer inherits another's writeback.
        names = list(writers)[r % 3:] + list(writers)[:r % 3]
        for name in names:
            save, load = writers[name]
            os.sync()
            started = time.perf_counter()
            save(r)
            times[name][0].append(time.perf_counter() - started)
            started = time.perf_counter()
            load(r)
            times[name][1].append(time.perf_counter() - started)
    rows = {name: (statistics.median(s), statistics.median(l)) for name, (s, l) in times.items()}

    # The stall of an async save: the steps run while a save is in flight (from the save() call until the write
    # has finished, at least one step), against as many plain steps.
    plain = []
    i = 10
    asynchronous = Checkpointer(root / "ours_async", rank=0, world_size=1, token="0", async_save=True,
                                deferred_copy=True, keep_last=1)
    asynchronous.save(i, model, optimizer, topo, extra={"step": i}, config={})  # maps its staging buffers
    asynchronous.wait()
    for _ in range(args.repeats):
        started = time.perf_counter()
        step(i)
        plain.append(time.perf_counter() - started)
        i += 1
    step_s = statistics.median(plain)
    stalls = []
    for r in range(args.repeats):
        os.sync()
        started = time.perf_counter()
        asynchronous.save(i, model, optimizer, topo, extra={"step": i}, config={})
        steps = 0
        while steps == 0 or asynchronous._thread is not None and asynchronous._thread.is_alive():
            step(i)
            i, steps = i + 1, steps + 1
        stalls.append((time.perf_counter() - started - steps * step_s, steps))
        asynchronous.wait()
    host_bytes = asynchronous.last_host_bytes
    stall, steps_in_flight = statistics.median(s for s, _ in stalls), statistics.median(n for _, n in stalls)

    print("\n| | save (s) | load (s) | save ratio to ours | load ratio to ours |\n| --- | --- | --- | --- | --- |")
    for name, (save_s, load_s) in rows.items():
        print(f"| {name} | {save_s:.2f} | {load_s:.2f} | {save_s / rows['ours'][0]:.2f} | "
              f"{load_s / rows['ours'][1]:.2f} |")
    copy_s = statistics.median(copies)
    print(f"\ncopy of the state into the warm host staging buffers (what an async save holds training for when "
          f"other cores do the writing): {copy_s:.2f} s = {100 * copy_s / rows['ours'][0]:.1f}% of the sync save")
    print(f"first save of a run (maps the host staging buffers): {first_save:.2f} s")
    print(f"\nasync: plain step {step_s:.2f} s; {steps_in_flight:.0f} steps ran while the save was in flight, "
          f"{stall:.2f} s longer than plain steps = {100 * stall / rows['ours'][0]:.1f}% of the sync save; "
          f"host copy {host_bytes / 2**30:.2f} GiB (one save in flight at a time)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
