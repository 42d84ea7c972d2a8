# The training entry point for real: torchrun with 2 CPU processes (gloo) on a synthetic corpus with a learnable
# pattern, written by this test's own MMIDIDX writer, and a WordLevel tokenizer trained on the spot.
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.runtime_train.helpers import REPO, build_tokenizer, write_mmidx

NUM_WORDS = 64
STEPS = 30


def _corpus(directory, mmidx_writer, tokenizer_builder):
    """Two corpora of 'counting' documents, token[t+1] = token[t] + stride (mod 64), and a blend file.

    Within a document the next token follows from the two before it, so the loss can fall far below
    ln(vocab); only document starts are unpredictable.
    """
    vocab = tokenizer_builder(directory / "tokenizer.json", [f"w{i}" for i in range(NUM_WORDS)])
    rng = np.random.default_rng(0)
    for name, strides in (("count_a", (1, 2)), ("count_b", (3, 5))):
        docs = []
        for _ in range(150):
            start, stride, length = rng.integers(NUM_WORDS), rng.choice(strides), rng.integers(40, 120)
            words = (start + stride * np.arange(length)) % NUM_WORDS
            docs.append(words + 1)  # WordLevel ids: <unk> is 0, then w0.. in training order is not guaranteed
        mmidx_writer(directory / name, docs)
    (directory / "blend.txt").write_text("# weight prefix corpus\n600 count_a a\n400 count_b b\n")
    return vocab


def _config(tmp_path, reference_config, architecture, *, tp, devices, name, steps=STEPS):
    raw = reference_config(architecture, results_dir=tmp_path / name, data_prefix=str(tmp_path / "data/blend.txt"),
                           tokenizer=tmp_path / "data/tokenizer.json")
    raw["trainer"].update(devices=devices, max_steps=steps, log_every_n_steps=5, val_check_interval=10,
                          limit_val_batches=2)
    model = raw["model"]
    model.update(tensor_model_parallel_size=tp, encoder_seq_length=32, max_position_embeddings=32, num_layers=2,
                 hidden_size=64, ffn_hidden_size=176 if architecture == "llama" else 256, micro_batch_size=2,
                 global_batch_size=8, make_vocab_size_divisible_by=16)
    model["data"].update(seq_length=32, splits_string="90,5,5", index_mapping_dir=str(tmp_path / "index"))
    model["optim"]["lr"] = 1e-2
    model["optim"]["sched"].update(warmup_steps=3, min_lr=1e-3)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(config, nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if nproc == 1:
        command = [sys.executable, "-m", "runtime.train", "--config", str(config)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   "-m", "runtime.train", "--config", str(config)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _records(results):
    lines = (results / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    (root / "data").mkdir()
    vocab = _corpus(root / "data", write_mmidx, build_tokenizer)
    return root, vocab


def _run_forked(config, nproc, capfd):
    """runtime.train's main() in `nproc` ranks forked from this process (tests/checkpoint/launch_helpers.train_here),
    its output as _run's: a torch import per rank and torchrun's own saved where the launch is not under test."""
    from tests.checkpoint.launch_helpers import train_here
    from tests.runtime_parallel.dist_utils import run_distributed

    capfd.readouterr()
    codes = run_distributed(train_here, nproc, args=(str(config), "training"))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([], 0 if codes == [0] * nproc else 1, out, err)


@pytest.mark.slow
# GPT under torchrun (the launch: one line printed once, warnings once per run); the Llama at tp 2 in forked ranks,
# the same entry point and checks, without torchrun's and two fresh interpreters' torch imports.
@pytest.mark.parametrize("architecture, tp, torchrun", [("gpt", 1, True), ("llama", 2, False)])
def test_torchrun_two_processes_learns(workdir, reference_config, capfd, architecture, tp, torchrun):
    root, vocab = workdir
    name = f"{architecture}_tp{tp}"
    config = _config(root, reference_config, architecture, tp=tp, devices=2, name=name)
    result = _run(config, nproc=2) if torchrun else _run_forked(config, 2, capfd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train, val = _records(root / name)
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20, 25, 30]
    for record in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops_per_device", "mfu",
                "memory_gib"} <= record.keys()
        assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0
        assert 0 < record["mfu"] <= 1  # against the CPU's theoretical peak (the old measured one gave 113%)
        # Every rank's peak host memory, gathered: the highest, its rank, and the one node's two ranks summed.
        assert 0.1 < record["host_peak_gib"] < record["node_host_peak_gib"] <= 2 * record["host_peak_gib"]
        assert record["host_peak_rank"] in (0, 1)
    assert train[0]["loss"] > 0.9 * math.log(vocab)
    assert train[-1]["loss"] < 0.5 * math.log(vocab), [r["loss"] for r in train]
    assert [r["step"] for r in val] == [10, 20, 30] and val[-1]["val_loss"] < val[0]["val_loss"]
    assert list((root / name / "tensorboard").glob("events.out.tfevents.*"))
    last = f"step {STEPS}/{STEPS} (eta 0:00:00) | loss"
    assert last in result.stdout  # the compact line, printed once (rank 0 only)
    assert result.stdout.count(last) == 1
    assert (result.stdout + result.stderr).count("Warning") <= 1, "a warning is printed once per run, not per rank"
    assert f"tensorboard: tensorboard --logdir {root / name / 'tensorboard'}" in result.stdout


@pytest.mark.slow
def test_data_parallel_run_matches_single_process(workdir, reference_config):
    """DP=2 reads exactly the single process's global batches, so the losses agree to rounding. Both runs are
    runtime.train's own main() in ranks forked from this process (tests/checkpoint/launch_helpers.train_here): what
    is under test is which samples each rank reads; starting under torchrun is the test above's."""
    from tests.checkpoint.launch_helpers import train_here
    from tests.runtime_parallel.dist_utils import run_distributed

    root, _ = workdir
    reference = _config(root, reference_config, "gpt", tp=1, devices=1, name="gpt_single", steps=10)
    assert run_distributed(train_here, 1, args=(str(reference), "training")) == [0]
    single, _ = _records(root / "gpt_single")
    dp2_config = _config(root, reference_config, "gpt", tp=1, devices=2, name="gpt_dp2", steps=10)
    assert run_distributed(train_here, 2, args=(str(dp2_config), "training")) == [0, 0]
    dp2, _ = _records(root / "gpt_dp2")
    assert [r["step"] for r in single] == [r["step"] for r in dp2]
    for a, b in zip(single, dp2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (single, dp2)


def test_config_errors_are_one_line_each_and_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"run": {"name": "x", "results_dir": str(tmp_path)}, "trainer": {"max_steps": 1},
                                   "precision": {"type": "fp16"}, "model": {}}))
    result = subprocess.run([sys.executable, "-m", "runtime.train", "--config", str(bad)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    assert "error: training.precision.type: 'fp16' is not one of fp32, bf16SR" in result.stderr
    assert "error: training.model.hidden_size: missing" in result.stderr
    assert "Traceback" not in result.stderr
