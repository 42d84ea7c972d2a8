"""`cancel` of a local run, on a real (tiny, CPU) training launched by the real CLI: the training's workers get
SIGUSR1, save a checkpoint and exit 75; the launcher stops there (no conversion) and exits 75, not 241 as a
killed stage made it; status, from another directory through the run index, shows CANCELLED. On the way: status
shows the step, loss and time left of the running training, and `logs -f` ends when the stage does."""

import json
import os
import subprocess
import sys
import time

import pytest

from .helpers import REPO, nxdt

# A model that takes well under a second a step on a shared CPU, and a max_steps it never reaches.
TINY = ["stages=[data_preparation,training,conversion]", "cluster_type=local", "training.trainer.devices=1",
        "training.trainer.max_steps=100000", "training.trainer.log_every_n_steps=1", "training.trainer.preflight=false",
        "training.trainer.val_check_interval=100000", "training.model.num_layers=1", "training.model.hidden_size=32",
        "training.model.num_attention_heads=2", "training.model.encoder_seq_length=32",
        "training.model.micro_batch_size=2", "training.model.global_batch_size=2",
        "training.exp_manager.create_tensorboard_logger=false",
        # The first stage, whose exit code the record keeps: the demo data, a quarter MB in one shard and one
        # tokenizer process (the default 4 MB in 2 shards costs 10 s of CPU; 3 s so).
        "data_preparation.demo.max_mb=0.25", "data_preparation.demo.num_shards=1",
        "data_preparation.workers_per_node=1", "data_preparation.tokenizer.train.vocab_size=512"]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_cancel_saves_a_checkpoint_and_stops_the_pipeline(tmp_path):
    env = {"NXDT_USER_CONFIG_DIR": str(tmp_path / "config")}
    results = tmp_path / "results"
    launch = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", *TINY, f"base_results_dir={results}", f"data_dir={tmp_path / 'data'}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), **env}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    follow = None
    try:
        metrics = results / "gpt3_tiny" / "training" / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2 or launch.poll() is not None,
                  300, "two training steps")
        assert launch.poll() is None, launch.stdout.read()
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        status = nxdt("status", "gpt3_tiny", cwd=elsewhere, env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "RUNNING" in status.stdout and "training: step " in status.stdout and " of 100000 (0%), loss " \
            in status.stdout and " left at " in status.stdout, status.stdout
        follow = subprocess.Popen([sys.executable, "-m", "launcher.cli", "logs", "-f", "gpt3_tiny", "training"],
                                  cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        cancel = nxdt("cancel", "gpt3_tiny", "--timeout", "240", cwd=elsewhere, env=env, timeout=300)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "training: SIGUSR1 to its workers" in cancel.stdout, cancel.stdout
        output, _ = launch.communicate(timeout=60)
        assert launch.returncode == 75, output  # stopped at a checkpoint (runtime/preemption.py), not 241
        assert "saved a checkpoint at step" in output and "cancelled by nxdt-launch cancel: training" in output
        assert "conversion (3/3)" not in output, "a stage after the cancelled one ran"

        followed, errors = follow.communicate(timeout=60)  # it ends with the stage
        assert follow.returncode == 0, errors
        assert "saved a checkpoint at step" in followed and "exited with 75" in followed
    finally:
        for process in (launch, follow):
            if process is not None and process.poll() is None:
                process.kill()

    checkpoints = list((results / "gpt3_tiny" / "training" / "checkpoints").glob("step_*"))
    assert checkpoints, "no checkpoint was saved"
    status = nxdt("status", "gpt3_tiny", cwd=elsewhere, env=env, timeout=60)
    assert "CANCELLED (stopped at a checkpoint)" in status.stdout, status.stdout
    assert "NOT RUN (the run was cancelled)" in status.stdout
    record = json.loads((results / "gpt3_tiny" / "launch.json").read_text())
    assert [s["exit_code"] for s in record["stages"]] == [0, 75, None]
    assert nxdt("cancel", "gpt3_tiny", cwd=elsewhere, env=env).stdout.startswith("nothing to cancel")
