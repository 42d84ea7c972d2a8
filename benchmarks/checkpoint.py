"""Checkpoint save, load, reshard load and async stall for a >= 300M-parameter GPT (fp32, AdamW state) on CPU.

Ours (runtime/checkpoint, a sync save and a load that checks every block it reads) side by side with two
references in the same run, the order rotated each repeat, medians of `--repeats`:
  torch.save       model.state_dict() and the Adam moments in one file, then fsync (what a hand-written
                   trainer does), and torch.load back
  DCP              torch.distributed.checkpoint.save / load of the same state dict (the library the issue
                   names; single process)
Every writer fsyncs its files, so the save numbers are the disk's, not the page cache's; loads read what the
saves left in the page cache, as a resume on the same node would.

Reshard: the same model saved at tp=2 (two gloo processes, spawned first) and loaded into the tp=1 model,
against the same-layout load of ours, alternating, after one untimed load of each.

The async figure is the stall: from the save() call until its write has finished, how much longer the training
steps that ran took than as many plain steps (median of `--repeats`).

    python benchmarks/checkpoint.py [--layers 24 --hidden 1024] [--repeats 3] [--dir /tmp/nxdt-ckpt-bench]
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
from runtime.checkpoint.shards import HostStaging, rank_pieces  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model  # noqa: E402
from runtime.step import train_step  # noqa: E402


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())


def _drop_from_page_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _model(args, tp: int):
    topo = Topology.build(ParallelDims(tp=tp, pp=1, dp=1, world_size=tp))
    cfg = ModelConfig(architecture="gpt", vocab_size=32768, hidden_size=args.hidden, num_layers=args.layers,
                      num_attention_heads=args.hidden // 64, ffn_hidden_size=4 * args.hidden,
                      max_position_embeddings=args.seq, share_embeddings_and_output_weights=True)
    model = parallelize_model(build_model(cfg), topo, sequence_parallel=False, data_parallel=DataParallelConfig())
    optimizer = ShardedAdamW(model, {"lr": 1e-4})
    return cfg, topo, model, optimizer


def _setup(args):
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{args.dir}/.pg", rank=0, world_size=1)
    return _model(args, tp=1)


def _save_tp2(rank: int, args) -> None:
    """One of the two processes that save the tp=2 checkpoint the reshard load reads."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{args.dir}/.pg_tp2", rank=rank, world_size=2)
    _, topo, model, optimizer = _model(args, tp=2)
    for moment in optimizer.exp_avg + optimizer.exp_avg_sq:
        moment.uniform_()  # state that checksums like trained state, not pages of zeros
    Checkpointer(Path(args.dir) / "tp2", rank=rank, world_size=2, token="0", async_save=False).save(
        1, model, optimizer, topo, extra={"step": 1}, config={})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


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
    load_before = os.getloadavg()[0]
    import torch.multiprocessing as mp

    mp.spawn(_save_tp2, args=(args,), nprocs=2, join=True)  # before this process's model takes its memory
    cfg, topo, model, optimizer = _setup(args)
    params = sum(p.numel() for p in model.data_parallel.params)
    step = lambda i: train_step(model, optimizer, _batch(cfg, args, i), topo, lr=1e-4, clip=1.0)  # noqa: E731
    for i in range(2):
        step(i)
    state_bytes = sum(t.numel() * t.element_size() for t in (
        [b.param_buffer for b in model.data_parallel.buckets] + optimizer.exp_avg + optimizer.exp_avg_sq))
    print(f"model: {params / 1e6:.0f}M parameters; weights + Adam moments {state_bytes / 2**30:.2f} GiB; "
          f"{torch.get_num_threads()} threads")

    # What an async save holds training for when other cores do the writing: the copy of this rank's pieces into
    # the host staging buffers, which stay allocated for the run (the first copy also maps them).
    staging, pieces = HostStaging(), rank_pieces(model.data_parallel, optimizer, topo)
    copies = []
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        staging.copy(pieces)
        copies.append(time.perf_counter() - started)
    first_copy, copies = copies[0], copies[1:]
    del staging, pieces

    # One Checkpointer for ours, as in training; a sync save writes the live host tensors where they are.
    ours = Checkpointer(root / "ours", rank=0, world_size=1, token="0", async_save=False, keep_last=1)
    ours.save(1, model, optimizer, topo, extra={"step": 1}, config={})
    import torch.distributed.checkpoint as dcp

    def save_ours(r):
        ours.save(2 + r, model, optimizer, topo, extra={"step": 2 + r}, config={})

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
    shutil.rmtree(root / "dcp", ignore_errors=True)  # leave the page cache to the two checkpoints compared next
    (root / "torch.pt").unlink(missing_ok=True)

    # Reshard: the tp=2 checkpoint into this tp=1 model, against ours saved at tp=1 (the same layout).
    def load_from(location):
        storage, committed = resolve_checkpoint(str(location))
        started = time.perf_counter()
        load_checkpoint(storage, committed, model, optimizer, topo, rank=0)
        return time.perf_counter() - started

    loads = {"same layout (tp=1 into tp=1)": root / "ours", "reshard (tp=2 into tp=1)": root / "tp2"}
    reshard_times = {name: [] for name in loads}
    # Both checkpoints into the page cache the same way. Ours was saved just now, the tp=2 one first (and the saves
    # since evicted it), and a page a save left in the cache is read faster than one read back from the disk: in
    # a process that only loads, re-reading both from the disk raised the same-layout load's CPU time by 0.16 s
    # and the reshard's by 0.08 s (of about 1). So both are dropped from the cache, then read back once, untimed.
    os.sync()
    for location in loads.values():
        _drop_from_page_cache(location)
    for location in loads.values():
        load_from(location)
    for r in range(args.repeats):
        for name in list(loads)[r % 2:] + list(loads)[:r % 2]:
            reshard_times[name].append(load_from(loads[name]))
    reshard = {name: statistics.median(t) for name, t in reshard_times.items()}

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
    host_bytes = asynchronous.staging_bytes  # the ring (CPU): no copy of the state
    stall, steps_in_flight = statistics.median(s for s, _ in stalls), statistics.median(n for _, n in stalls)

    print(f"\nload average (1 min): {load_before:.2f} before the run, {os.getloadavg()[0]:.2f} after")
    print(f"median of {args.repeats}; every repeat in seconds, in run order of the repeats:")
    listed = lambda values: ", ".join(f"{t:.2f}" for t in values)  # noqa: E731
    for name, (save_list, load_list) in times.items():
        print(f"  {name}: save {listed(save_list)}; load {listed(load_list)}")
    print("\n| | save (s) | load (s) | save ratio to ours | load ratio to ours |\n| --- | --- | --- | --- | --- |")
    for name, (save_s, load_s) in rows.items():
        print(f"| {name} | {save_s:.2f} | {load_s:.2f} | {save_s / rows['ours'][0]:.2f} | "
              f"{load_s / rows['ours'][1]:.2f} |")
    print("\n| ours, load | seconds (median) | every repeat | ratio to the same-layout load |\n"
          "| --- | --- | --- | --- |")
    same = reshard["same layout (tp=1 into tp=1)"]
    for name, median in reshard.items():
        print(f"| {name} | {median:.2f} | {listed(reshard_times[name])} | "
              f"{median / same:.2f} |")
    copy_s = statistics.median(copies)
    print(f"\ncopy of the state into the warm host staging buffers (what an async save holds training for when "
          f"other cores do the writing): {copy_s:.2f} s = {100 * copy_s / rows['ours'][0]:.1f}% of the sync save")
    print(f"the first copy of a run (also maps the host staging buffers): {first_copy:.2f} s")
    print(f"\nasync: plain step {step_s:.2f} s; {steps_in_flight:.0f} steps ran while the save was in flight, "
          f"{stall:.2f} s longer than plain steps = {100 * stall / rows['ours'][0]:.1f}% of the sync save; "
          f"host staging {host_bytes / 2**30:.2f} GiB (one save in flight at a time)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
