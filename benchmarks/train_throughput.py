"""Single-process training throughput of our models against Hugging Face transformers at the same size.

Each contender runs full training steps (forward, backward, gradient clipping, AdamW) on the same random
tokens: our GPT and Llama through runtime.step.train_step with data parallelism and ShardedAdamW (the trainer's path,
one process), and transformers' GPT2LMHeadModel / LlamaForCausalLM with torch.optim.AdamW. Runs alternate
within one process (ours, HF, ours, HF, ...) so drift in machine load hits both sides alike, and a square
fp32 matmul measured in the same run gives the practical peak that achieved TFLOP/s are compared with.

    python benchmarks/train_throughput.py                      # hidden 1024, 4 layers, seq 512, batch 1
    python benchmarks/train_throughput.py --layers 2 --rounds 2 --profile
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from runtime.metrics import flops_per_token  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.parallel import AdamWConfig, ParallelDims, ShardedAdamW, Topology, apply_data_parallel  # noqa: E402
from runtime.step import train_step  # noqa: E402

def measure_matmul_tflops(device: torch.device, size: int = 1024, dtype=torch.float32, seconds: float = 0.3) -> float:
    """Achieved TFLOP/s of a square matmul on `device`: the yardstick this benchmark compares steps with."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):  # warm up caches, thread pools, kernels
        a @ b
    count, start = 0, time.perf_counter()
    while True:
        c = a @ b
        count += 1
        _ = c[0, 0].item()  # forces completion on asynchronous devices
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 3:
            return 2.0 * size**3 * count / elapsed / 1e12


LR, CLIP = 1e-4, 1.0


def our_runner(architecture: str, args):
    cfg = ModelConfig(
        architecture=architecture, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_attention_heads=args.heads, ffn_hidden_size=_ffn(architecture, args), max_position_embeddings=args.seq,
        num_query_groups=args.kv_heads if architecture == "llama" else None,
        share_embeddings_and_output_weights=architecture == "gpt",
    )
    model = build_model(cfg)
    # Counted before data parallelism gives a tied embedding its alias Parameter (which parameters() lists too).
    params = model.num_params()
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))  # no process group: a single process
    apply_data_parallel(model, topo)
    optimizer = ShardedAdamW(model, AdamWConfig(lr=LR, weight_decay=0.1, betas=(0.9, 0.95)))

    def step(input_ids, labels):
        return train_step(model, optimizer, [(input_ids, labels, None)], topo, lr=LR, clip=CLIP).loss

    return step, params


def hf_runner(architecture: str, args):
    import transformers

    if architecture == "gpt":
        config = transformers.GPT2Config(
            vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
            n_inner=_ffn("gpt", args), activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True,
        )
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    else:
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=_ffn("llama", args),
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.seq, rope_theta=10000.0, tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))

    def step(input_ids, labels):
        # HF shifts labels itself, so it gets the unshifted tokens; the FLOPs per step are the same.
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss.item()

    return step, sum(p.numel() for p in model.parameters())


def _ffn(architecture: str, args) -> int:
    return 4 * args.hidden if architecture == "gpt" else args.llama_ffn


def time_steps(step, batch, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4, help="llama key/value heads (GQA)")
    parser.add_argument("--llama-ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step of ours")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(f"# torch {torch.__version__}, {args.threads} threads; hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads, seq {args.seq}, batch {args.batch}, vocab {args.vocab}", flush=True)
    print(f"# load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    peak = measure_matmul_tflops(torch.device("cpu"), size=2048, seconds=2.0)
    print(f"# measured fp32 matmul peak (2048^3): {peak:.3f} TFLOP/s", flush=True)

    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    ours_batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    hf_batch = (tokens[:, :-1].contiguous(), None)
    contenders = {}
    for architecture in ("gpt", "llama"):
        for side, make in (("ours", our_runner), ("hf", hf_runner)):
            step, params = make(architecture, args)
            batch = ours_batch if side == "ours" else hf_batch
            time_steps(step, batch, args.warmup)
            contenders[(architecture, side)] = {"step": step, "batch": batch, "params": params, "times": []}

    # Interleave single steps (ours, HF, HF, ours, ...) so that a burst of load from elsewhere on the machine
    # lands on both sides of a comparison rather than on one contender's whole block.
    for round_index in range(args.rounds):
        for architecture in ("gpt", "llama"):
            for index in range(args.steps):
                sides = ("ours", "hf") if (index + round_index) % 2 == 0 else ("hf", "ours")
                for side in sides:
                    c = contenders[(architecture, side)]
                    c["times"] += time_steps(c["step"], c["batch"], 1)
        print(f"# round {round_index + 1}/{args.rounds} done", flush=True)

    tokens_per_step = args.batch * args.seq
    # Other work on the machine skews absolute numbers (ratios less so): say how busy it was.
    print(f"# load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print()
    print("| model | params (M) | ours tok/s | HF tok/s | ours / HF | ours / HF, paired | ours TFLOP/s (of peak) "
          "| HF TFLOP/s (of peak) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for architecture in ("gpt", "llama"):
        per_token = flops_per_token(
            args.layers, args.hidden, _ffn(architecture, args), args.heads,
            args.kv_heads if architecture == "llama" else args.heads, args.vocab, args.seq,
            gated_mlp=architecture == "llama",
        )
        rates, cells = {}, {}
        for side in ("ours", "hf"):
            c = contenders[(architecture, side)]
            rates[side] = tokens_per_step / statistics.median(c["times"])
            tflops = per_token * rates[side] / 1e12
            cells[side] = f"{tflops:.3f} ({100 * tflops / peak:.0f}%)"
        params = contenders[(architecture, "ours")]["params"] / 1e6
        # Step i of ours ran right next to step i of HF: the median of their ratios shrugs off load bursts.
        pairs = zip(contenders[(architecture, "ours")]["times"], contenders[(architecture, "hf")]["times"])
        paired = statistics.median(hf / ours for ours, hf in pairs)
        print(f"| {architecture} | {params:.1f} | {rates['ours']:.0f} | {rates['hf']:.0f} | "
              f"{rates['ours'] / rates['hf']:.2f} | {paired:.2f} | {cells['ours']} | {cells['hf']} |")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for architecture in ("gpt", "llama"):
            c = contenders[(architecture, "ours")]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                c["step"](*c["batch"])
            print(f"\n## profile: ours, {architecture}, one step")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
