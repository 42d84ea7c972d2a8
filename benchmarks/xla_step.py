"""A training step on XLA:CPU, before and after issue 41, side by side in one run: steady step time, graphs and
device-to-host transfers per step, compiles over the run, and the matmul work a steady step traces.

    python benchmarks/xla_step.py --before <a checkout of the older runtime> [--after .] [--out xla_step.json]

Each checkout trains the same config (the gpt model below, single process, 30 steps, a validation and a checkpoint
save every 10: the issue's scenario) twice in the XLA environment (csp_tools/xla_venv.sh):
- a timed run: counts read from torch-xla's debug metrics around every call of train_step (from one call to the
  next: the step and whatever the loop did after it), step times from metrics.jsonl;
- a traced run of 4 steps with no validation or save and XLA_SAVE_TENSORS_FILE set, which appends the IR of every
  graph executed: the text appended during step 3 holds every graph that step ran, whose matmuls (aten::mm, bmm,
  matmul, addmm, baddbmm) are counted. One forward and one backward of the step's two micro-batches trace
  2 x (forward + 2 x forward) matmuls: the forward's, and the backward's two per forward matmul.
Both checkouts run the driver below with their own `runtime` package first on sys.path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
XLA_PYTHON = Path.home() / ".cache/nxdt/xla-venv/bin/python"
STEPS, EVERY = 30, 10
MODEL = dict(encoder_seq_length=128, max_position_embeddings=128, num_layers=4, hidden_size=256, ffn_hidden_size=1024,
             num_attention_heads=8, micro_batch_size=4, global_batch_size=8, make_vocab_size_divisible_by=128)
MATMUL = re.compile(r" aten::(?:mm|bmm|matmul|addmm|baddbmm)\(")

DRIVER = r'''
import json, os, sys, time
checkout, config, out = sys.argv[1:4]
sys.path.insert(0, checkout)
import torch_xla.debug.metrics as met
import runtime.train as T

def counts():
    return [int((met.metric_data(name) or [0])[0]) for name in ("CompileTime", "ExecuteTime", "TransferFromDeviceTime")]

dump = os.environ.get("XLA_SAVE_TENSORS_FILE")
def dumped():
    return sum(os.path.getsize(p) for p in (dump, f"{dump}.0") if dump and os.path.exists(p))

marks, step = [], T.train_step
def counted(*args, **kwargs):
    marks.append([time.perf_counter(), *counts(), dumped()])
    return step(*args, **kwargs)
T.train_step = counted
code = T.main(["--config", config])
marks.append([time.perf_counter(), *counts(), dumped()])
json.dump({"code": code, "marks": marks}, open(out, "w"))
'''


def write_config(root: Path, name: str, *, steps: int, every: int) -> Path:
    sys.path.insert(0, str(REPO))
    import numpy as np
    import yaml

    from tests.runtime_train.helpers import build_tokenizer, reference_training_config, write_mmidx

    if not (root / "tokenizer.json").exists():
        build_tokenizer(root / "tokenizer.json", [f"w{i}" for i in range(200)])
        rng = np.random.default_rng(0)
        write_mmidx(root / "corpus", [rng.integers(1, 200, rng.integers(100, 400)) for _ in range(400)])
    raw = reference_training_config("gpt", results_dir=root / name, data_prefix=[1.0, str(root / "corpus")],
                                    tokenizer=root / "tokenizer.json")
    raw["trainer"].update(accelerator="neuron", devices=1, max_steps=steps, log_every_n_steps=1,
                          val_check_interval=every, limit_val_batches=1, gradient_clip_val=1.0)
    raw["model"].update(MODEL)
    raw["model"]["optim"]["sched"].update(warmup_steps=2, constant_steps=0)
    raw["model"]["data"].update(seq_length=MODEL["encoder_seq_length"], splits_string="90,5,5",
                                index_mapping_dir=str(root / f"index_{name}"))
    raw["exp_manager"]["create_tensorboard_logger"] = False
    raw["exp_manager"]["create_checkpoint_callback"] = every > 0
    raw["exp_manager"]["checkpoint_callback_params"]["every_n_train_steps"] = every
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(checkout: Path, config: Path, out: Path, env: dict) -> dict:
    driver = out.with_suffix(".driver.py")
    driver.write_text(DRIVER)
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONPATH=str(checkout), **env)
    result = subprocess.run([str(XLA_PYTHON), str(driver), str(checkout), str(config), str(out)], cwd=checkout,
                            env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0 or json.loads(out.read_text())["code"] != 0:
        raise SystemExit(f"{checkout}: {result.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(checkout: Path, work: Path, label: str) -> dict:
    config = write_config(work, f"{label}_timed", steps=STEPS, every=EVERY)
    marks = run(checkout, config, work / f"{label}_timed.json", {})["marks"]
    # Per iteration: from its train_step call to the next one (the last: to the end of the run).
    spans = [[b[i] - a[i] for i in range(5)] for a, b in zip(marks, marks[1:])]
    rows = [json.loads(line) for line in open(work / f"{label}_timed" / "metrics.jsonl") if '"loss"' in line]
    quiet = [s for s in range(3, STEPS + 1) if s % EVERY not in (0, 1)]  # no validation or save in or just before
    traced = write_config(work, f"{label}_traced", steps=4, every=0)
    dump = work / f"{label}.ir"
    tmarks = run(checkout, traced, work / f"{label}_traced.json", {"XLA_SAVE_TENSORS_FILE": str(dump),
                                                                   "XLA_SAVE_TENSORS_FMT": "text"})["marks"]
    text = "".join(p.read_text() for p in (dump, Path(f"{dump}.0")) if p.exists()).encode()
    step3 = text[tmarks[2][4]:tmarks[3][4]].decode(errors="replace")
    return {
        "steady_step_s": statistics.median(rows[s - 1]["step_time_s"] for s in quiet),
        "graphs_per_step": statistics.median(spans[s - 1][2] for s in quiet),
        "transfers_per_step": statistics.median(spans[s - 1][3] for s in quiet),
        "compiles": sum(s[1] for s in spans) + marks[0][1],
        "compiles_after_step_3": sum(s[1] for s in spans[3:]),
        "matmuls_per_step": len(MATMUL.findall(step3)),
        "losses": [r["loss"] for r in rows],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the runtime to compare against")
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nxdt-xla-step-") as tmp:
        results = {label: measure(path.resolve(), Path(tmp), label)
                   for label, path in (("before", args.before), ("after", args.after))}
    before, after = results["before"], results["after"]
    # F: one micro-batch's forward matmuls; a step of 2 micro-batches traces 2 x 3F once forward and backward.
    print("| | before | after | before / after |\n| --- | --- | --- | --- |")
    for key in ("steady_step_s", "graphs_per_step", "transfers_per_step", "compiles", "compiles_after_step_3",
                "matmuls_per_step"):
        ratio = before[key] / after[key] if after[key] else float("nan")
        print(f"| {key} | {before[key]:.4g} | {after[key]:.4g} | {ratio:.2f} |")
    drift = max(abs(a - b) / abs(a) for a, b in zip(before["losses"], after["losses"]))
    print(f"\nlargest relative loss difference over the {STEPS} steps: {drift:.2e}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
