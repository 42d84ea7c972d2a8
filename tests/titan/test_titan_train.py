"""The launcher-rendered torchtitan job trains on CPU in 2 processes (torchrun, gloo), with the FAKE accelerator of
tests/titan/cpu_shim.py standing in for the Neuron/CUDA device: `nxdt-launch cluster_type=local
stages=[data_preparation,training] training=llama/tiny training.runtime=torchtitan` prepares the demo corpus, writes
the job module (training_titan_job.py) beside the stage config and trains it under FSDP with a checkpoint every 2
steps; a relaunch of the training stage without the step-4 checkpoint resumes from step 2 and repeats steps 3 and 4
bitwise; the same recipe at tensor_model_parallel_size=2 trains on the same prepared data."""
import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is the optional extra nxdt-launch[torchtitan]")

from launcher.stages import TITAN_MODULE
from tests.launcher.helpers import nxdt
from tests.titan.conftest import losses, shim_env

RUN, TP_RUN = "llama_tiny", "llama_tiny_tp"
# The demo corpus at its smallest: one shard of 50 kB of the standard library and a 512-token BPE (seconds, not a
# minute); steps of 2 ranks x 2 samples of 32 tokens.
DATA = ["data_preparation.demo.num_shards=1", "data_preparation.demo.max_mb=0.05",
        "data_preparation.tokenizer.train.vocab_size=512"]
TRAINING = ["cluster_type=local", "training=llama/tiny", "training.runtime=torchtitan", "training.trainer.devices=2",
            "training.trainer.max_steps=4", "training.trainer.log_every_n_steps=1",
            "training.exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "training.model.optim.sched.warmup_steps=1",  # the recipe's 15 exceed 4 steps (our schema refuses it)
            "training.model.encoder_seq_length=32", "training.model.micro_batch_size=2",
            "training.model.global_batch_size=4"]


def launch(cwd, *overrides: str) -> str:
    """nxdt-launch with the fake accelerator's environment passed to the stages' scripts; the run's stdout."""
    done = nxdt(*TRAINING, *overrides, cwd=cwd, env=shim_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return done.stdout


def job_module(training) -> Path:
    """The one generated module under a stage's results directory (launches/<launch id>/)."""
    [module] = (training / "launches").glob(f"*/{TITAN_MODULE}")
    return module


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """(the launch's cwd, step -> loss) of the data preparation and FSDP training launched once for this file."""
    cwd = tmp_path_factory.mktemp("titan-launch")
    launch(cwd, "stages=[data_preparation,training]", *DATA)
    return cwd, losses(cwd / "results" / RUN / "training")


def test_the_launch_renders_the_job_and_trains_it_under_fsdp_with_checkpoints(launched):
    cwd, uninterrupted = launched
    training = cwd / "results" / RUN / "training"
    # The launch wrote the generated module beside the stage config, and the job script runs it (contract 2).
    module = job_module(training)
    assert f"-m runtime.titan.train --job {module}" in (training / "training.local.sh").read_text()
    assert "data_parallel_shard_degree=2," in module.read_text()  # FSDP over the 2 ranks
    # torchtitan's layout: <checkpoint dirpath>/step-N, each a DCP directory (.metadata).
    checkpoints = training / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4"]
    assert (checkpoints / "step-2" / ".metadata").is_file()
    assert sorted(uninterrupted) == [1, 2, 3, 4] and all(math.isfinite(v) for v in uninterrupted.values())
    status = nxdt("status", RUN, cwd=cwd)
    assert status.returncode == 0, status.stdout + status.stderr
    assert any("training" in line and "COMPLETED" in line for line in status.stdout.splitlines()), status.stdout


def test_a_relaunch_without_the_last_checkpoint_resumes_from_step_2_bitwise(launched):
    # Without step 4, the relaunched stage's torchtitan loads the newest step-N (2) with its model, optimizer, lr
    # schedule and data position, and trains steps 3 and 4 again (metrics.jsonl appends them).
    cwd, uninterrupted = launched
    training = cwd / "results" / RUN / "training"
    shutil.rmtree(training / "checkpoints" / "step-4")
    launch(cwd, "stages=[training]")
    rows = [json.loads(line) for line in (training / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 3, 4]
    assert [row["loss"] for row in rows[4:]] == [uninterrupted[3], uninterrupted[4]]  # bitwise: the same floats
    assert sorted(p.name for p in (training / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_tensor_parallel_trains_on_the_same_prepared_data(launched):
    cwd, _ = launched
    launch(cwd, "stages=[training]", f"training.run.name={TP_RUN}", "training.model.tensor_model_parallel_size=2",
           "training.exp_manager.create_checkpoint_callback=false")
    tp = cwd / "results" / TP_RUN / "training"
    text = job_module(tp).read_text()
    assert "tensor_parallel_degree=2," in text and "data_parallel_shard_degree=1," in text
    by_step = losses(tp)
    assert sorted(by_step) == [1, 2, 3, 4] and all(math.isfinite(v) for v in by_step.values()), by_step
    assert by_step[4] < by_step[1], by_step
