"""CPU step time of the same Llama 3 shaped model in torchtitan 0.3.0 and in our runtime, at the same layout.

Both sides train 2 ranks (torchrun, gloo, one thread each) on the same Megatron .bin/.idx corpus, with the same
shape, global batch, micro-batch and sequence length, fp32, gradient clipping 1.0, AdamW:

- dp2: our ZeRO-1 data parallelism (model.zero1=true) against torchtitan's FSDP (data_parallel_shard_degree 2);
- dp2-keep: the same, torchtitan's FSDP with fsdp_reshard_after_forward=never (no all-gathers in the backward);
- tp2: our tensor parallelism against torchtitan's (tensor_parallel_degree 2).

torchtitan runs the job module launcher/titan_module.py renders, under the test-only FAKE accelerator of
tests/titan/cpu_shim.py (torchtitan does not train on a CPU as shipped). Its attention is therefore the shim's
dense boolean mask under scaled_dot_product_attention standing in for FlexAttention: the ratio is of this CPU
stand-in, not of torchtitan on Trainium or a GPU.

Each side's step time is the median of the steps after the first --warmup, from its metrics.jsonl: ours is the
data fetch plus the training step (runtime/train.py; its per-step logging is outside), torchtitan's the time
between two logged steps (runtime/titan/metrics.py: its whole loop iteration, logging included, metrics every
step). The runs are sequential; --rounds alternates ours and torchtitan that many times.

    python benchmarks/titan_step.py                        # hidden 256, 4 layers, seq 256, global batch 8
    python benchmarks/titan_step.py --layouts dp2 --steps 8 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

LAYOUTS = {  # name -> (our model keys, torchtitan's parallelism keys, torchtitan's CLI overrides)
    "dp2": ({"zero1": True}, {"data_parallel_shard_degree": 2}, ()),
    # FSDP keeping each layer's gathered weights from its forward to its backward: half the per-layer all-gathers
    # (FSDP's memory saving given up), to show what its collectives cost on this machine.
    "dp2-keep": ({"zero1": True}, {"data_parallel_shard_degree": 2},
                 ("--parallelism.fsdp_reshard_after_forward", "never")),
    "tp2": ({"tensor_model_parallel_size": 2}, {"tensor_parallel_degree": 2}, ()),
}


def write_corpus(root: Path, vocab: int) -> list[list]:
    """Random documents of 100-600 tokens (our data_preparation's writer) and a tokenizer.json of `vocab` ids."""
    import numpy as np

    from runtime.data_prep.indexed import IndexedDatasetWriter, token_dtype
    from tests.runtime_train.helpers import build_tokenizer

    assert build_tokenizer(root / "tokenizer.json", [f"w{i}" for i in range(vocab - 1)]) == vocab
    writer = IndexedDatasetWriter(root / "corpus.bin", root / "corpus.idx", token_dtype(vocab))
    rng = np.random.default_rng(0)
    for length in rng.integers(100, 600, size=600):
        writer.add_document(rng.integers(1, vocab, size=int(length)))
    writer.finish()
    return [[1.0, str(root / "corpus")]]


def our_config(root: Path, name: str, blend: list[list], args, layout: dict) -> Path:
    import yaml

    from tests.runtime_train.helpers import reference_training_config

    raw = reference_training_config("llama", results_dir=root / name, tokenizer=root / "tokenizer.json",
                                    data_prefix=[part for weight, prefix in blend for part in (weight, prefix)])
    raw["trainer"].update(devices=2, max_steps=args.steps, log_every_n_steps=1, val_check_interval=0,
                          limit_val_batches=0, preflight=False, gradient_clip_val=1.0)
    raw["exp_manager"].update(create_tensorboard_logger=False, create_metrics_plot=False,
                              create_checkpoint_callback=False)
    raw["precision"]["type"] = "fp32"
    raw["model"].update(
        encoder_seq_length=args.seq, max_position_embeddings=args.seq, num_layers=args.layers,
        hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, rotary_base=500000.0, layernorm_epsilon=1e-5,
        share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=1,
        micro_batch_size=args.micro_batch, global_batch_size=args.global_batch, **layout)
    raw["model"]["optim"].update(lr=3e-4, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    raw["model"]["optim"]["sched"].update(warmup_steps=2, min_lr=3e-5)
    raw["model"]["data"].update(seq_length=args.seq, splits_string="98,1,1", index_mapping_dir=str(root / "index"))
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def titan_job(root: Path, name: str, blend: list[list], args, parallelism: dict) -> Path:
    from tests.titan.conftest import context, write_job

    model = {"dim": args.hidden, "n_layers": args.layers, "n_heads": args.heads, "n_kv_heads": args.kv_heads,
             "hidden_dim": args.ffn, "vocab_size": args.vocab, "rope_theta": 500000.0, "norm_eps": 1e-5,
             "max_seq_len": args.seq}
    ctx = context(blend, root / name, model=model, parallelism=parallelism,
                  training={"local_batch_size": args.micro_batch, "global_batch_size": args.global_batch,
                            "seq_len": args.seq, "steps": args.steps, "deterministic": False},
                  optimizer={"lr": 3e-4}, lr_scheduler={"warmup_steps": 2},
                  data={"index_dir": str(root / "index")})
    return write_job(ctx, root / f"{name}.py")


def run_ours(config: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "runtime.train", "--config", str(config)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"our runtime failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def run_titan(job: Path, overrides: tuple[str, ...]) -> None:
    from tests.titan.conftest import run_titan as run

    run(job, 2, *overrides, timeout=600)  # the FAKE accelerator of tests/titan/cpu_shim.py in torchrun's workers


def step_times(results: Path, warmup: int) -> list[float]:
    rows = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
    return [row["step_time_s"] for row in rows if "loss" in row and row["step"] > warmup]


def measure(root: Path, blend: list[list], args) -> dict[str, dict[str, list[list[float]]]]:
    """layout -> {"ours": [[s/step...] of each round], "torchtitan": [...]}."""
    times: dict[str, dict[str, list[list[float]]]] = {}
    for layout in args.layouts:
        ours_keys, titan_keys, overrides = LAYOUTS[layout]
        times[layout] = {"ours": [], "torchtitan": []}
        for round_ in range(args.rounds):
            for side in ("ours", "torchtitan"):
                name, started = f"{side}_{layout}_{round_}", time.perf_counter()
                if side == "ours":
                    run_ours(our_config(root, name, blend, args, ours_keys))
                else:
                    run_titan(titan_job(root, name, blend, args, titan_keys), overrides)
                got = step_times(root / name, args.warmup)
                times[layout][side].append(got)
                print(f"{name}: median {statistics.median(got):.3f} s/step over {len(got)} steps "
                      f"({time.perf_counter() - started:.0f} s with start-up)", flush=True)
    return times


def report(times: dict, args) -> None:
    tokens = args.global_batch * args.seq
    print(f"\nhidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), ffn {args.ffn}, "
          f"vocab {args.vocab}, seq {args.seq}, global batch {args.global_batch} (micro {args.micro_batch}), fp32, "
          f"2 ranks; medians of steps {args.warmup + 1}..{args.steps} x {args.rounds} round(s)")
    print("| layout | ours s/step | torchtitan s/step | ours tokens/s | torchtitan tokens/s | torchtitan / ours | "
          "each round's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layout, sides in times.items():
        ours, titan = (statistics.median([t for got in sides[side] for t in got]) for side in ("ours", "torchtitan"))
        # A round's two runs are back to back, so their ratio carries less of the machine's changing load.
        rounds = ", ".join(f"{statistics.median(t) / statistics.median(o):.2f}"
                           for o, t in zip(sides["ours"], sides["torchtitan"]))
        print(f"| {layout} | {ours:.3f} | {titan:.3f} | {tokens / ours:,.0f} | {tokens / titan:,.0f} | "
              f"**{titan / ours:.2f}** | {rounds} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--rounds", type=int, default=1, help="ours then torchtitan, this many times per layout")
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args(argv)
    unknown = [layout for layout in args.layouts if layout not in LAYOUTS]
    if unknown or args.steps <= args.warmup:
        parser.error(f"--layouts: choose from {', '.join(LAYOUTS)}" if unknown else "--steps must exceed --warmup")
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        parser.error("torchtitan is not installed: pip install 'nxdt-launch[torchtitan]'")
    with tempfile.TemporaryDirectory(prefix="titan_step_") as tmp:
        root = Path(tmp)
        blend = write_corpus(root, args.vocab)
        report(measure(root, blend, args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
