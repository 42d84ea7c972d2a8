"""Forward + backward tokens/s of our sparse MoE block (runtime/models/moe.py) against transformers'
MixtralSparseMoeBlock with the same weights, sizes and inputs, interleaved step by step in one process.

Theirs loops over the experts a batch reaches and gathers each expert's tokens with a mask; ours sorts the
(token, slot) assignments by expert once and runs all experts as two batched matmuls over the busiest expert's
count (padding the others). The outputs are checked equal before timing.

    python benchmarks/moe_block.py [--hidden 1024] [--ffn 3584] [--experts 8] [--top-k 2] [--tokens 2048] [--steps 12]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from runtime.models.moe import SparseMoE  # noqa: E402


def _step(block, x: torch.Tensor) -> float:
    started = time.perf_counter()
    block(x).square().mean().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                        num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                                        router_jitter_noise=0.0)
    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(config).train()
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.02)
    ours = SparseMoE(args.hidden, args.ffn, args.experts, args.top_k).train()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.gate_up.copy_(theirs.experts.gate_up_proj.transpose(1, 2))
        ours.down.copy_(theirs.experts.down_proj.transpose(1, 2))
    x = torch.randn(1, args.tokens, args.hidden)
    with torch.no_grad():
        difference = (ours(x) - theirs(x.clone())).abs().max().item()
    assert difference < 1e-4, f"the blocks disagree: max |difference| {difference}"

    times = {"ours": [], "transformers": []}
    for step in range(args.steps + 2):  # two warm-up rounds, then alternate who goes first
        pair = [("ours", ours), ("transformers", theirs)]
        for name, block in (pair if step % 2 == 0 else pair[::-1]):
            block.zero_grad(set_to_none=True)
            elapsed = _step(block, x.clone())
            if step >= 2:
                times[name].append(elapsed)
    ratios = [t / o for o, t in zip(times["ours"], times["transformers"])]
    print(f"# hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, transformers {transformers.__version__}")
    print("| block | tokens/s (median) | ours / transformers, paired median (min-max) |")
    print("| --- | --- | --- |")
    for name in ("ours", "transformers"):
        rate = args.tokens / statistics.median(times[name])
        cell = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if name == "ours" else "1.00")
        print(f"| {name} | {rate:,.0f} | {cell} |")


if __name__ == "__main__":
    main()
