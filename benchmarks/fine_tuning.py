"""Fine-tuning stages on CPU: SFT with packing against one example per row, and LoRA against full fine-tuning.

1. Packing. The synthetic instruction set (runtime.sft.synthetic, ChatML) made into rows by the runtime's own
   build_sft_dataset, packed and not, read as the trainer reads them (epoch_samples -> DataParallelBatches, 4-tuple
   micro-batches) and trained by train_step on the tiny Llama (4 layers, hidden 128, 4 heads, 2 KV groups, SwiGLU
   352; fp32, global batch 16 rows in micro-batches of 4). Every row costs the same (a row is seq_length positions
   either way, padding included, and both layouts take the packed-attention path), so useful tokens per second is
   rows per second times the dataset's useful tokens per row: non-padding tokens, and loss-carrying (assistant)
   tokens. Packed/unpacked of those is the padding waste.
2. LoRA against full fine-tuning of a larger Llama (8 layers, hidden 512, 8 heads, 4 KV groups, SwiGLU 1408,
   sequence 256, packed SFT rows), per precision (fp32, bf16SR, mixed_precision), each through the trainer's path
   (apply_lora -> parallelize_model with DataParallelConfig -> ShardedAdamW -> train_step). LoRA: rank 16, alpha 32,
   every projection (all_linear), as peft=llama/tiny. Sizes are read from the objects: Adam moments from
   ShardedAdamW.exp_avg / exp_avg_sq, the fp32 master copy from the DataParallel buckets, gradients from the main
   gradients (flat buffer, or autograd's fp32 tensors kept as they are). Memory is torch's, not the process's: the
   first two steps of each variant run under torch.profiler(profile_memory=True) from before build_model, and
   replaying its allocation events gives the live tensor bytes held at the start of step 2 (weights, gradients,
   optimizer state, RoPE tables) and the peak during step 2 (that plus activations and temporaries).

Variants alternate step by step in one process (A B B A ...), so load from other work lands on both sides of a
ratio; "paired" is the median ratio of back-to-back steps.

    python benchmarks/fine_tuning.py            # the README's tables: about 4 minutes on 2 shared cores
    python benchmarks/fine_tuning.py --quick    # smoke check, under a minute: small data, small model, few steps
    python benchmarks/fine_tuning.py --data-dir /tmp/sft_demo --threads 2   # keep the data; on a quiet machine
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from runtime.data.loader import DataParallelBatches  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.models.lora import apply_lora  # noqa: E402
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model  # noqa: E402
from runtime.schema.choices import LORA_MODULES  # noqa: E402
from runtime.schema.rules import padded_vocab_size  # noqa: E402
from runtime.schema.training_config import LoraConfig  # noqa: E402
from runtime.schema.chat import ChatTokenizer  # noqa: E402
from runtime.sft.dataset import build_sft_dataset, epoch_samples  # noqa: E402
from runtime.sft.synthetic import write_demo  # noqa: E402
from runtime.step import train_step  # noqa: E402

MiB = 2**20
LR, WEIGHT_DECAY, CLIP, SEED = 1e-4, 0.01, 1.0, 1234
STEP_MARK = "fine_tuning_bench_step"


@dataclasses.dataclass
class Data:
    train: Path
    tokenizer: Path
    cache: Path
    vocab_size: int  # padded as the launcher pads it (make_vocab_size_divisible_by 128)


def prepare_data(directory: Path, num_train: int) -> Data:
    """The synthetic instruction set (python -m runtime.sft.synthetic --output-dir DIR), written once per DIR."""
    write_demo(directory, num_train=num_train)
    tokenizer = directory / "tokenizer.json"
    vocab = ChatTokenizer(tokenizer).tokenizer.get_vocab_size()
    return Data(directory / "train.jsonl", tokenizer, directory / "cache", padded_vocab_size(vocab, 128))


def sft_rows(data: Data, seq: int, packing: bool):
    return build_sft_dataset([data.train], data.tokenizer, seq, packing=packing, cache_dir=data.cache)


def trainer(cfg: ModelConfig, topo: Topology, precision: str, lora: LoraConfig | None):
    """build_model -> [apply_lora] -> parallelize_model (data parallelism last) -> ShardedAdamW, as runtime/train.py."""
    model = build_model(cfg)
    if lora is not None:
        apply_lora(model, lora, SEED)
    model = parallelize_model(model, topo, data_parallel=DataParallelConfig(precision=precision, seed=SEED))
    return model, ShardedAdamW(model, dict(lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95)))


def llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                       num_attention_heads=heads, num_query_groups=kv_heads, ffn_hidden_size=ffn,
                       max_position_embeddings=seq, seed=SEED)


def interleave(contenders: list[dict], rounds: int, steps: int, label: str) -> None:
    """Each contender's `step()` timed once per turn, turns in order then reversed (A B, B A, ...)."""
    for round_index in range(rounds):
        for index in range(steps):
            order = contenders if (round_index * steps + index) % 2 == 0 else contenders[::-1]
            for c in order:
                start = time.perf_counter()
                c["step"]()
                c["times"].append(time.perf_counter() - start)
        print(f"# {label}: round {round_index + 1}/{rounds} done", flush=True)


def paired(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    ratios = sorted(a / b for a, b in zip(numerator, denominator))
    return statistics.median(ratios), ratios[0], ratios[-1]


# ---- 1. packing -------------------------------------------------------------------------------------------------

def packing_contender(data: Data, seq: int, packing: bool, topo: Topology, args) -> dict:
    rows = sft_rows(data, seq, packing)
    cfg = llama(128, 4, 4, 2, 352, seq, data.vocab_size)
    model, optimizer = trainer(cfg, topo, "fp32", None)
    needed = (args.warmup + args.rounds * args.steps) * args.global_batch
    batches = DataParallelBatches(epoch_samples(rows, needed, SEED), args.global_batch, args.micro_batch)

    def step():  # one trainer iteration: read the global batch, then train on it
        train_step(model, optimizer, batches.next_batch(), topo, lr=LR, clip=CLIP)

    for _ in range(args.warmup):
        step()
    return {"seq": seq, "packing": packing, "stats": dict(rows.stats), "rows": len(rows), "step": step, "times": []}


def run_packing(data: Data, topo: Topology, args) -> list[dict]:
    results = []
    for seq in args.seqs:
        pair = [packing_contender(data, seq, packing, topo, args) for packing in (True, False)]
        results += pair
    # All four contenders in one interleaved loop, so both sequence lengths see the same load too.
    interleave(results, args.rounds, args.steps, "packing")
    return results


def report_packing(results: list[dict], args) -> None:
    print(f"\n### SFT: packed rows against one example per row (tiny Llama, fp32, global batch {args.global_batch} "
          f"rows, micro-batch {args.micro_batch}; {len(results[0]['times'])} timed steps each)\n")
    print("| seq | rows | rows per epoch | padding fraction | step (s), median | rows/s | non-padding tokens/s | "
          "loss tokens/s | one epoch (s, est.) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rates = {}
    for r in results:
        stats, step = r["stats"], statistics.median(r["times"])
        rows_per_s = args.global_batch / step
        tokens, loss = rows_per_s * stats["tokens"] / r["rows"], rows_per_s * stats["loss_tokens"] / r["rows"]
        rates[(r["seq"], r["packing"])] = (step, tokens, loss, r["rows"] / rows_per_s)
        print(f"| {r['seq']} | {'packed' if r['packing'] else 'one per row'} | {r['rows']:,} | "
              f"{stats['padding_fraction']:.3f} | {step:.3f} | {rows_per_s:.1f} | {tokens:,.0f} | {loss:,.0f} | "
              f"{r['rows'] / rows_per_s:,.0f} |")
    print("\n| seq | packed / one per row: useful tokens/s (non-padding and loss alike) | paired (min-max) | "
          "rows per epoch | step time, paired (min-max) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for seq in args.seqs:
        packed, unpacked = (next(r for r in results if r["seq"] == seq and r["packing"] is p) for p in (True, False))
        tokens_ratio = rates[(seq, True)][1] / rates[(seq, False)][1]
        # Per pair: (rows_u / rows_p) rows per epoch x (t_u / t_p) per step = useful tokens/s ratio of that pair.
        row_ratio = unpacked["rows"] / packed["rows"]
        pair_mid, pair_lo, pair_hi = paired(unpacked["times"], packed["times"])
        step_mid, step_lo, step_hi = paired(packed["times"], unpacked["times"])
        print(f"| {seq} | **{tokens_ratio:.2f}** | {row_ratio * pair_mid:.2f} ({row_ratio * pair_lo:.2f}-"
              f"{row_ratio * pair_hi:.2f}) | {packed['rows'] / unpacked['rows']:.3f} | {step_mid:.3f} "
              f"({step_lo:.3f}-{step_hi:.3f}) |")


# ---- 2. LoRA against full fine-tuning ---------------------------------------------------------------------------

def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def memory_from_events(events) -> tuple[int, int]:
    """(live tensor bytes at the start of the second marked step, peak live bytes during it): the profiler's
    [memory] events replayed in time order (frees are negative)."""
    steps = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == STEP_MARK)
    start, end = steps[1]
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live, held, peak = 0, None, 0
    for when, nbytes in allocations:
        if when > end:
            break
        if held is None and when >= start:
            held = peak = live
        live += nbytes
        if held is not None:
            peak = max(peak, live)
    return (live if held is None else held), peak


def lora_contender(cfg: ModelConfig, precision: str, use_lora: bool, batches: list, topo: Topology) -> dict:
    lora = LoraConfig(rank=16, alpha=32.0, dropout=0.0, target_modules=tuple(LORA_MODULES)) if use_lora else None
    # Two warm-up steps under the memory profiler, from before the model exists, so every byte it holds is seen.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, optimizer = trainer(cfg, topo, precision, lora)
        for index in range(2):
            with record_function(STEP_MARK):
                train_step(model, optimizer, batches[index % len(batches)], topo, lr=LR, clip=CLIP)
    held, peak = memory_from_events(prof.profiler.kineto_results.events())
    dp = optimizer.data_parallel
    moments = sum(m.nbytes + v.nbytes for m, v in zip(optimizer.exp_avg, optimizer.exp_avg_sq))
    master = sum(b.master.nbytes for b in dp.buckets if b.master is not None)
    grads = storage_bytes(main.value for main in dp.main_grads.values())
    counter = iter(range(10**9))

    def step():
        train_step(model, optimizer, batches[next(counter) % len(batches)], topo, lr=LR, clip=CLIP)

    return {"precision": precision, "lora": use_lora, "step": step, "times": [],
            "trainable": sum(p.numel() for p in dp.params), "total": sum(p.numel() for p in model.parameters()),
            "weights": storage_bytes(model.parameters()), "grads": grads, "moments": moments, "master": master,
            "held": held, "peak": peak}


def run_lora(data: Data, topo: Topology, args) -> tuple[list[dict], ModelConfig]:
    cfg = llama(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.lora_seq, data.vocab_size)
    rows = sft_rows(data, args.lora_seq, True)
    loader = DataParallelBatches(epoch_samples(rows, 4 * args.lora_batch, SEED), args.lora_batch, args.lora_batch)
    batches = [loader.next_batch() for _ in range(4)]  # the same four global batches for every variant
    results = []
    for precision in args.precisions:
        for use_lora in (False, True):
            results.append(lora_contender(cfg, precision, use_lora, batches, topo))
            print(f"# built {precision} {'LoRA' if use_lora else 'full'}", flush=True)
    interleave(results, args.lora_rounds, args.steps, "LoRA / full")
    return results, cfg


def report_lora(results: list[dict], cfg: ModelConfig, args) -> None:
    print(f"\n### LoRA (rank 16, all_linear) against full fine-tuning: Llama {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads / {cfg.kv_heads} KV, SwiGLU {cfg.ffn_hidden_size}, "
          f"vocabulary {cfg.vocab_size}, {args.lora_batch} x {args.lora_seq} tokens per step (one micro-batch); "
          f"{len(results[0]['times'])} timed steps each\n")
    print("| precision | method | trainable params | weights (MiB) | gradients (MiB) | Adam moments (MiB) | "
          "fp32 master (MiB) | held between steps, measured (MiB) | peak in a step, measured (MiB) | "
          "step (s), median |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['precision']} | {'LoRA' if r['lora'] else 'full'} | {r['trainable']:,} "
              f"({r['trainable'] / r['total']:.1%}) | {r['weights'] / MiB:.1f} | {r['grads'] / MiB:.1f} | "
              f"{r['moments'] / MiB:.1f} | {r['master'] / MiB:.1f} | {r['held'] / MiB:.1f} | "
              f"{r['peak'] / MiB:.1f} | {statistics.median(r['times']):.3f} |")
    print("\n| precision | LoRA / full: step time, medians | paired (min-max) | trainable params | "
          "optimizer state (moments + master) | gradients | held between steps | peak in a step | "
          "peak above held (activations, temporaries) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for precision in args.precisions:
        full, lora = (next(r for r in results if r["precision"] == precision and r["lora"] is side)
                      for side in (False, True))
        mid, lo, hi = paired(lora["times"], full["times"])
        ratio = lambda key: lora[key] / full[key]  # noqa: E731
        optimizer = (lora["moments"] + lora["master"]) / (full["moments"] + full["master"])
        above = (lora["peak"] - lora["held"]) / (full["peak"] - full["held"])
        print(f"| {precision} | **{statistics.median(lora['times']) / statistics.median(full['times']):.2f}** | "
              f"{mid:.2f} ({lo:.2f}-{hi:.2f}) | {ratio('trainable'):.4f} | {optimizer:.4f} | {ratio('grads'):.4f} | "
              f"{ratio('held'):.3f} | **{ratio('peak'):.3f}** | {above:.3f} |")


# ---- driver -----------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke check: small data and model, few steps")
    parser.add_argument("--data-dir", help="where the synthetic set is written (default: a fresh /tmp directory, "
                                           "removed at the end)")
    parser.add_argument("--num-train", type=int, help="training records (default 20000, --quick 4000)")
    parser.add_argument("--seqs", default="128,256", help="packing: sequence lengths")
    parser.add_argument("--global-batch", type=int, default=16, help="packing: rows per step")
    parser.add_argument("--micro-batch", type=int, default=4, help="packing: rows per micro-batch")
    parser.add_argument("--warmup", type=int, default=2, help="packing: untimed steps per contender")
    parser.add_argument("--rounds", type=int, help="packing: rounds of --steps steps each (default 10)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender and round")
    parser.add_argument("--layers", type=int, help="LoRA: layers (default 8)")
    parser.add_argument("--hidden", type=int, help="LoRA: hidden size (default 512)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, help="LoRA: SwiGLU width (default 1408)")
    parser.add_argument("--lora-seq", type=int, default=256)
    parser.add_argument("--lora-batch", type=int, default=2, help="LoRA: rows per step, one micro-batch")
    parser.add_argument("--lora-rounds", type=int, help="LoRA: rounds of --steps steps each (default 10)")
    parser.add_argument("--precisions", default="fp32,bf16SR,mixed_precision")
    # One thread by default: with other work on the 2 cores, two OpenMP threads wait on each other at every op (the
    # tiny model's step took 0.21 s steadily at 1 thread and 0.6-18 s at 2 while another process used ~1.9 cores).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    args = parser.parse_args()
    quick = args.quick
    args.num_train = args.num_train or (4000 if quick else 20000)
    args.rounds = args.rounds or (1 if quick else 10)
    args.lora_rounds = args.lora_rounds or (1 if quick else 10)
    args.layers = args.layers or (2 if quick else 8)
    args.hidden = args.hidden or (256 if quick else 512)
    args.ffn = args.ffn or (704 if quick else 1408)
    if quick:
        args.steps, args.warmup = 1, 1
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.precisions = args.precisions.split(",")
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)

    started = time.perf_counter()
    scratch = None if args.data_dir else Path(tempfile.mkdtemp(prefix="nxdt_fine_tuning_bench_"))
    try:
        data = prepare_data(Path(args.data_dir) if args.data_dir else scratch, args.num_train)
        print(f"# torch {torch.__version__}, {args.threads} threads; load average at the start "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.num_train} training records, vocabulary "
              f"{data.vocab_size}", flush=True)
        topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))  # one process, no process group
        packing = run_packing(data, topo, args)
        lora, cfg = run_lora(data, topo, args)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}; {time.perf_counter() - started:.0f} s in all")
    report_packing(packing, args)
    report_lora(lora, cfg, args)


if __name__ == "__main__":
    main()
