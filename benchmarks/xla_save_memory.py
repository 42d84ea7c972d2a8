"""Host memory of asynchronous saves on XLA:CPU (issue 56), before and after, side by side: a rank's peak RSS
sampled from outside, against 1.25 x its own state + the fixed part.

    python benchmarks/xla_save_memory.py --before <a checkout of the older runtime> [--after .] [--out out.json]
    # issue 56 (benchmarks/xla_save_memory.json): git archive d9d1827 | tar -x -C /tmp/before, then
    python benchmarks/xla_save_memory.py --before /tmp/before --out benchmarks/xla_save_memory.json

Each run trains the same config (the GPT model below, one process, PJRT_DEVICE=CPU in the XLA environment:
csp_tools/xla_venv.sh) for 8 steps; the save runs checkpoint asynchronously at steps 2, 4 and 6 (and synchronously at
8, the last). A run without checkpoints (the --after checkout) gives the fixed part. Every 0.05 s the process's RSS
and its kernel high-water mark (VmHWM) are read from /proc; the peak before the first save is the high-water mark
when metrics.jsonl first holds step 2 (written before that step's save).

On XLA:CPU the device is host memory: a rank's RSS holds its device state too. So
  own state   weights, gradients and two Adam moments, fp32: 16 bytes per parameter, which a save's log line gives
              as 12 (what the rank saves: weights and moments) x 16 / 12
  fixed part  the run without checkpoints: its peak minus its own state (torch-xla, the compiled graphs, the
              activations, the data)
  staging     the host memory a save holds besides the state, as the code counts it (rank 0's commit line: the
              ring's most held at once after issue 56; before it, 0 is logged on XLA although the save held a
              device-side clone and a host copy of what it saves while it wrote)
Targets: peak after the saves <= 1.25 x own state + fixed part.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import xla_step  # noqa: E402  its config, corpus and environment

REPO, XLA_PYTHON = xla_step.REPO, xla_step.XLA_PYTHON
STEPS, EVERY = 8, 2
# ~93M parameters (1.5 GB of fp32 state) mostly in the embedding and output layer (a vocabulary padded to 32768
# rows), 2 layers and tiny batches: the state, not the activations, dominates, and XLA:CPU compiles the step fast.
MODEL = {**xla_step.MODEL, "encoder_seq_length": 64, "max_position_embeddings": 64, "num_layers": 2,
         "hidden_size": 1024, "ffn_hidden_size": 4096, "num_attention_heads": 16, "micro_batch_size": 1,
         "global_batch_size": 1, "make_vocab_size_divisible_by": 32768}
COMMIT = re.compile(r"committed: ([0-9.]+) GiB from rank 0, ([0-9.]+) GiB host staging")
GIB = 2**30


def write_config(root: Path, name: str, *, every: int) -> Path:
    """benchmarks/xla_step.py's config (its corpus and tokenizer) with this benchmark's model, steps and saves."""
    import yaml

    path = xla_step.write_config(root, name, steps=STEPS, every=every)
    raw = yaml.safe_load(path.read_text())
    raw["model"].update(MODEL)
    raw["model"]["data"]["seq_length"] = MODEL["encoder_seq_length"]
    raw["trainer"]["val_check_interval"] = STEPS
    path.write_text(yaml.safe_dump(raw))
    return path


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(checkout: Path, config: Path) -> dict:
    """Train `config` with `checkout`'s runtime; the peak RSS before the first save and over the run."""
    with socket.socket() as free:  # torch-xla's one-process world listens on MASTER_PORT (12355 unless set)
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONPATH=str(checkout), MASTER_PORT=str(port),
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
    metrics = Path(str(config).removesuffix(".yaml")) / "metrics.jsonl"
    log = config.with_suffix(".log")
    with open(log, "w") as err:
        process = subprocess.Popen([str(XLA_PYTHON), "-m", "runtime.train", "--config", str(config)], cwd=checkout,
                                   env=env, stdout=subprocess.DEVNULL, stderr=err)
        peak = before_save = 0
        while process.poll() is None:
            peak = max(peak, _status_kib(process.pid, "VmHWM"), _status_kib(process.pid, "VmRSS"))
            if not before_save and metrics.exists() and '"step": 2,' in metrics.read_text():
                before_save = peak
            time.sleep(0.05)
    text = log.read_text()
    if process.returncode != 0:
        raise SystemExit(f"{checkout}: {text[-3000:]}")
    commits = [(float(a) * GIB, float(b) * GIB) for a, b in COMMIT.findall(text)]
    return {"peak_bytes": peak * 1024, "peak_before_first_save_bytes": before_save * 1024,
            "saved_bytes": commits[0][0] if commits else None,
            "staging_bytes": max((b for _, b in commits), default=None), "saves": len(commits)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nxdt_xla_save_memory_"))
    plain = run(args.after, write_config(work, "no_saves", every=0))
    rows = {label: run(checkout, write_config(work, f"saves_{label}", every=EVERY))
            for label, checkout in (("before", args.before), ("after", args.after))}
    own = rows["after"]["saved_bytes"] * 16 / 12
    fixed = plain["peak_bytes"] - own
    target = 1.25 * own + fixed
    result = {"own_state_bytes": own, "fixed_bytes": fixed, "target_bytes": target, "no_saves": plain, **rows}
    print(f"own state {own / GIB:.3f} GiB, fixed part {fixed / GIB:.3f} GiB (peak without saves "
          f"{plain['peak_bytes'] / GIB:.3f} GiB), target 1.25 x own + fixed = {target / GIB:.3f} GiB")
    print(f"{'':8} {'peak before 1st save':>22} {'peak after saves':>18} {'/ target':>9} {'staging (code)':>15}")
    for label, row in rows.items():
        row["ratio"] = row["peak_bytes"] / target
        print(f"{label:8} {row['peak_before_first_save_bytes'] / GIB:>18.3f} GiB {row['peak_bytes'] / GIB:>14.3f} GiB "
              f"{row['ratio']:>8.2f}x {row['staging_bytes'] / GIB:>11.3f} GiB")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
