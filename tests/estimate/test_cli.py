"""`nxdt-launch estimate` as a user runs it: the tables, the device it picks, and one-line errors."""

import pytest

from launcher.commands.estimate import slurm_seconds
from tests.launcher.helpers import nxdt


def test_estimate_prints_memory_and_time():
    result = nxdt("estimate", "training=llama3/8b", "cluster=pcluster_trn1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "llama3/8b: 8.03 B parameters on 4 × 32 trn1.32xlarge" in out
    assert "tp 32 · pp 1 · dp 4" in out
    for part in ("weights (bf16)", "gradients", "optimizer (Adam moments + fp32 master, ÷ dp 4 (ZeRO-1))",
                 "activations", "fits", "time to train", "run.time_limit"):
        assert part in out, part


def test_estimate_takes_overrides_and_options():
    result = nxdt("estimate", "training=gpt3/175b", "training.model.micro_batch_size=2", "--device", "h200",
                  "--tokens", "300B", "--mfu", "0.5")
    assert result.returncode == 0, result.stderr
    assert "H200 SXM 141 GB" in result.stdout and "micro-batch 2" in result.stdout
    assert "300.00 B" in result.stdout and "MFU 50%" in result.stdout


def test_estimate_says_when_a_layout_does_not_fit():
    result = nxdt("estimate", "training=llama3/70b", "training.model.activations_checkpoint_granularity=null")
    assert result.returncode == 0 and "does not fit" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["training=llama3/8b", "training.model.tensor_model_parallel_size=3"], "num_attention_heads"),
    (["training=llama3/9b"], "training=llama3/9b: no such choice"),
    (["--tokens", "many"], "--tokens 'many' is not a number"),
    (["training=llama3/8b", "training.model.tokenizer.model=/nowhere/tok.json"], "pass --vocab-size"),
])
def test_estimate_errors_are_one_line(args, message):
    result = nxdt("estimate", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error:") for line in lines), result.stderr
    assert message in result.stderr


def test_slurm_time_limits():
    assert slurm_seconds("30") == 1800 and slurm_seconds("10:30") == 630 and slurm_seconds("0:30:00") == 1800
    assert slurm_seconds("2-3") == 2 * 86400 + 3 * 3600 and slurm_seconds("6-12:00:00") == 6.5 * 86400
    assert slurm_seconds("UNLIMITED") is None
