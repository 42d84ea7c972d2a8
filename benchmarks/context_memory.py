"""Peak activation memory per rank under context parallelism (ring attention), measured, against the estimator.

For each sequence length and cp, a tiny Llama (fp32, micro-batch 1, world = cp so every rank of the one context
group holds seq / cp tokens of the same sample) is composed by the launcher as a launch would compose it
(training=llama/tiny plus overrides), and trained for 3 steps by the runtime's own train() in cp processes started
by torchrun (python -m torch.distributed.run), gloo on CPU. Every rank measures itself exactly as
tests/estimate/measure_memory.py does for one process (whose peak_live_bytes it reuses): train() under
torch.profiler with profile_memory, the [memory] events replayed in time order, the peak of live tensor bytes over
steps 2 and later. Each rank also records the live bytes at the start of step 2, before its forward: weights,
gradients (kept between steps), Adam's moments and the RoPE tables, the "static" part; peak minus that is the
activation part (saved activations, the loss's working set, backward's gradients, the ring's K/V buffers).

Compared with launcher.estimator.estimate() for the same composed config (device cpu): total (StageMemory.total)
against the measured peak, and total - static (activations + max(logits, backward)) against the measured
activation part. Ratios are to cp=1 at the same sequence length.

    python benchmarks/context_memory.py [--seqs 8192,16384,32768] [--cps 1,2,4] [--layers 2] [--hidden 128]
    # about 8 minutes on 2 cores; builds the demo corpus under --work (default /tmp/ctxbench) first (seconds),
    # prints a table and writes every rank's numbers to <work>/context_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MiB = 2**20


# ---- one rank (run by torchrun: --worker) ---------------------------------------------------------------------

def step_starts(events, mark: str) -> list[int]:
    """Live tensor bytes at the start of each marked step (the same replay as peak_live_bytes)."""
    steps = sorted(e.start_ns() for e in events if e.name() == mark)
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live, index, starts = 0, 0, []
    for start in steps:
        while index < len(allocations) and allocations[index][0] < start:
            live += allocations[index][1]
            index += 1
        starts.append(live)
    return starts


def worker(config: str, out_dir: str, threads: int) -> None:
    import torch

    from runtime.config import load_training_config
    from runtime.device import init_device, shutdown
    from tests.estimate.measure_memory import STEP_MARK, peak_live_bytes, profiled_train

    torch.set_num_threads(threads)
    device = init_device("cpu")
    cfg = load_training_config(config)
    events, seconds = profiled_train(cfg, device)
    starts = step_starts(events, STEP_MARK)
    result = {"rank": device.rank, "peak_bytes": peak_live_bytes(events), "static_bytes": starts[1],
              "step_start_bytes": starts, "seconds": seconds,
              "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(out_dir, f"rank{device.rank}.json").write_text(json.dumps(result))
    shutdown(device)


# ---- the driver ------------------------------------------------------------------------------------------------

def prepare_data(work: Path) -> Path:
    """The demo corpus, by the launcher's own data stage (seconds; skipped when it is there)."""
    data = work / "data"
    if not (data / "demo" / "blend.txt").exists():
        run = subprocess.run([sys.executable, "-m", "launcher.cli", "stages=[data_preparation]",
                              "cluster_type=local", f"data_dir={data}", f"base_results_dir={work / 'results'}"],
                             cwd=work, env=_env(), capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            sys.exit(f"data preparation failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return data


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def compose(seq: int, cp: int, args, data: Path, work: Path):
    """The training stage's config for one case, as `nxdt-launch` composes and writes it; and its estimate."""
    from launcher import launch
    from launcher.estimator import estimate

    overrides = ["stages=[training]", "cluster_type=local", "training=llama/tiny", f"data_dir={data}",
                 f"base_results_dir={work / 'results'}", f"run_name=ctx_s{seq}_cp{cp}",
                 "training.trainer.num_nodes=1", f"training.trainer.devices={cp}",
                 f"training.trainer.max_steps={args.steps}", "training.trainer.log_every_n_steps=1",
                 "training.trainer.val_check_interval=0", "training.trainer.preflight=false",
                 "training.exp_manager.create_checkpoint_callback=false",
                 "training.exp_manager.create_tensorboard_logger=false",
                 "training.exp_manager.create_metrics_plot=false",
                 "training.exp_manager.resume_if_exists=false",
                 "training.model.optim.sched.warmup_steps=1", "training.precision.type=fp32",
                 f"training.model.num_layers={args.layers}", f"training.model.hidden_size={args.hidden}",
                 f"training.model.encoder_seq_length={seq}", f"training.model.context_parallel_size={cp}",
                 "training.model.micro_batch_size=1", "training.model.global_batch_size=1"]
    plan = launch.make_plan(overrides, dry_run=True, produced_by="benchmarks/context_memory.py")
    launch.write(plan)
    return str(plan.jobs[0].config_path), estimate(plan.cfg["training"], device="cpu")


def measure(config: str, cp: int, work: Path, threads: int) -> list[dict]:
    out = work / "ranks" / Path(config).parent.parent.name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
               str(Path(__file__).resolve()), "--worker", config, "--out", str(out), "--threads", str(threads)]
    run = subprocess.run(command, cwd=work, env=_env(), capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(cp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="8192,16384,32768")
    parser.add_argument("--cps", default="1,2,4", help="context-parallel sizes; the first is the reference")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="4 heads, 2 KV heads, SwiGLU 352 (llama/tiny)")
    parser.add_argument("--steps", type=int, default=3, help="the peak is over steps 2 and later")
    parser.add_argument("--work", default="/tmp/ctxbench", help="scratch directory: corpus, runs, JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out, args.threads)
    if args.steps < 2:
        parser.error("--steps: at least 2 (step 1 builds lazily allocated state; the peak is over steps 2+)")
    seqs = [int(s) for s in args.seqs.split(",")]
    cps = [int(c) for c in args.cps.split(",")]
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1

    started = time.perf_counter()
    data = prepare_data(work)
    rows = []
    for seq in seqs:
        for cp in cps:
            config, est = compose(seq, cp, args, data, work)
            case_started = time.perf_counter()
            ranks = measure(config, cp, work, threads=max(1, cores // cp))
            memory = est.memory
            rows.append({"seq": seq, "cp": cp, "ranks": ranks, "seconds": time.perf_counter() - case_started,
                         "estimate": {"total": memory.total, "static": memory.static, "weights": memory.weights,
                                      "gradients": memory.gradients, "optimizer": memory.optimizer,
                                      "buffers": memory.buffers, "activations": memory.activations,
                                      "logits": memory.logits, "backward": memory.backward}})
            peak = max(r["peak_bytes"] for r in ranks)
            print(f"# seq {seq} cp {cp}: peak per rank {peak / MiB:.1f} MiB (estimate {memory.total / MiB:.1f}), "
                  f"{rows[-1]['seconds']:.0f} s", flush=True)
    elapsed = time.perf_counter() - started
    (work / "context_memory.json").write_text(json.dumps({"args": vars(args), "seconds": elapsed, "rows": rows},
                                                         indent=1))
    _report(rows, cps[0], args, elapsed, cores, work)


def _report(rows: list[dict], reference_cp: int, args, elapsed: float, cores: int, work: Path) -> None:
    import torch

    print(f"# tiny Llama: {args.layers} layers, hidden {args.hidden}, fp32, micro-batch 1, world = cp, gloo on "
          f"{cores} CPUs, torch {torch.__version__}; peak of live tensor bytes over steps 2-{args.steps}; "
          f"{elapsed:.0f} s in all; every rank's numbers in {work / 'context_memory.json'}")
    print()
    print("| seq | cp | tokens per rank | peak per rank, MiB: max (each rank) | static at step 2, MiB | "
          "activation part (peak - static), MiB | peak / cp=1 | activation / cp=1 (1/cp) | "
          "estimate: total, MiB (error) | estimate: static, MiB | estimate: activation part, MiB (error) |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    reference = {}
    for row in rows:
        seq, cp, ranks, est = row["seq"], row["cp"], row["ranks"], row["estimate"]
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        peak, static = worst["peak_bytes"], worst["static_bytes"]
        activation = peak - static
        if cp == reference_cp:
            reference[seq] = (peak, activation)
        base_peak, base_activation = reference.get(seq, (peak, activation))
        est_activation = est["total"] - est["static"]
        each = " / ".join(f"{r['peak_bytes'] / MiB:.1f}" for r in ranks)
        print(f"| {seq} | {cp} | {seq // cp} | {peak / MiB:.1f} ({each}) | {static / MiB:.1f} | "
              f"{activation / MiB:.1f} | {peak / base_peak:.3f} | {activation / base_activation:.3f} "
              f"({reference_cp / cp:.3f}) | {est['total'] / MiB:.1f} ({(est['total'] - peak) / peak:+.1%}) | "
              f"{est['static'] / MiB:.1f} | {est_activation / MiB:.1f} "
              f"({(est_activation - activation) / activation:+.1%}) |")


if __name__ == "__main__":
    main()
