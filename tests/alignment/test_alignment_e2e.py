"""The alignment stage end to end through the real CLI: the DPO demo (stages=[data_preparation,alignment]) learns
the preference rule on held-out prompts; a run killed with SIGKILL after a checkpoint resumes from it, reads the
reference log-probs cached by the first attempt instead of scoring the pairs again, and ends with the losses of a
run never interrupted; a damaged cache is named, recomputed and comes out the same; ORPO trains from the same data;
and DPO runs with dp=2 across the two nodes of the local Slurm cluster."""
from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.alignment.synthetic import write_demo
from runtime.checkpoint import committed_checkpoints, open_storage
from tests.launcher.helpers import REPO, nxdt

SCORED = "scored by the starting model, cached in "
QUIET = ["trainer.log_every_n_steps=1", "trainer.preflight=false", "exp_manager.create_tensorboard_logger=false",
         "exp_manager.create_metrics_plot=false"]
STEPS, EVERY = 20, 10  # the kill test: checkpoints at 10 and 20, the kill lands in between


def _stage(*overrides: str) -> list[str]:
    return [f"alignment.{o}" for o in QUIET + list(overrides)]


def _rows(stage_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _losses(stage_dir: Path) -> dict[int, float]:
    """step -> train loss, the last record of each step (a resumed run appends to the same file)."""
    return {row["step"]: row["loss"] for row in _rows(stage_dir) if "loss" in row}


def _output(result) -> str:
    return result.stdout + result.stderr


def _cached_paths(output: str) -> list[Path]:
    """The reference tables a run says it computed and wrote (none when it read them)."""
    return [Path(line.split(SCORED, 1)[1].strip()) for line in output.splitlines() if SCORED in line]


@pytest.fixture(scope="module")
def preference_data(tmp_path_factory) -> Path:
    """A data_dir holding preference_demo/ as data_preparation=preference_demo writes it, smaller."""
    data = tmp_path_factory.mktemp("data")
    write_demo(data / "preference_demo", num_train=1000, num_valid=64, num_test=64)
    return data


@pytest.mark.slow
@pytest.mark.long("DPO must measurably learn the preference on held-out prompts: 150 training steps")
def test_dpo_demo_learns_the_preference_on_held_out_prompts(tmp_path):
    result = nxdt("cluster_type=local", "stages=[data_preparation,alignment]", "data_preparation=preference_demo",
                  "data_preparation.synthetic_preferences.num_train=2000",
                  "data_preparation.synthetic_preferences.num_valid=256", "alignment=llama/tiny_dpo",
                  f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data",
                  *_stage("trainer.max_steps=60", "trainer.val_check_interval=30",
                          "trainer.limit_val_batches=16"),  # 16 batches of 16 pairs: all 256 validation pairs
                  cwd=tmp_path, timeout=600)
    output = _output(result)
    assert result.returncode == 0, output[-4000:]
    assert "2000 train pairs " + SCORED in output and "256 validation pairs " + SCORED in output, output[-4000:]
    rows = _rows(tmp_path / "results" / "llama_tiny_dpo" / "alignment")
    train = [row for row in rows if "loss" in row]
    valid = [row for row in rows if "val_loss" in row]
    assert [row["step"] for row in train] == list(range(1, 61)) and [row["step"] for row in valid] == [30, 60]
    # Step 1 scores the batch with the starting weights, which are the reference: no reward either way.
    first = train[0]
    assert first["reward_accuracy"] == 0.0 and first["reward_margin"] == 0.0, first
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), first
    assert valid[-1]["val_reward_accuracy"] >= 0.8, valid
    assert valid[-1]["val_reward_accuracy"] >= valid[0]["val_reward_accuracy"] > 0.5, valid
    assert valid[-1]["val_loss"] < valid[0]["val_loss"] < math.log(2), valid
    assert valid[-1]["val_reward_margin"] > valid[0]["val_reward_margin"] > 0, valid


def _stage_pids(config: Path) -> list[int]:
    """The processes whose command line names this stage config: torchrun and its runtime.train workers."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in cmdline and b"runtime.train" in cmdline:
            pids.append(int(entry.name))
    return pids


def _kill_after_checkpoint(launcher: subprocess.Popen, run_dir: Path, step: int) -> bool:
    """SIGKILL every process group of the stage once the step-`step` checkpoint is committed: the workers' own
    (torchrun starts each in a new session) first, so none takes another step, then the one of the stage script
    and torchrun."""
    checkpoints, config = open_storage(run_dir / "checkpoints"), run_dir / "alignment_config.yaml"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and launcher.poll() is None:
        if any(c.step == step for c in committed_checkpoints(checkpoints)):
            groups = []
            for pid in _stage_pids(config):
                try:
                    groups.append(os.getpgid(pid))
                except ProcessLookupError:
                    pass
            stage_group = json.loads((run_dir.parent / "launch.json").read_text())["stages"][0]["pid"]
            for group in sorted(set(groups) - {stage_group}) + [stage_group]:
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return len(groups) >= 3  # torchrun and both workers were found
        time.sleep(0.01)
    return False


@pytest.mark.slow
@pytest.mark.long("a DPO run killed mid-training and resumed must equal an uninterrupted one: two trainings")
def test_kill_minus_nine_resumes_with_the_cached_references(preference_data, tmp_path):
    def overrides(results: Path, *extra: str) -> list[str]:
        return ["cluster_type=local", "stages=[alignment]", "alignment=llama/tiny_dpo", f"data_dir={preference_data}",
                f"base_results_dir={results}",
                *_stage(f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0",
                        f"exp_manager.checkpoint_callback_params.every_n_train_steps={EVERY}",
                        "exp_manager.checkpoint_callback_params.save_top_k=-1", *extra)]

    # 1. The first attempt scores the pairs, caches the table, and is killed after its step-10 checkpoint.
    killed = overrides(tmp_path / "killed")
    run_dir = tmp_path / "killed" / "llama_tiny_dpo" / "alignment"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # as nxdt() runs the CLI
    launcher = subprocess.Popen([sys.executable, "-m", "launcher.cli", *killed], cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    killed_all = _kill_after_checkpoint(launcher, run_dir, EVERY)
    output, _ = launcher.communicate(timeout=300)
    assert killed_all, output[-4000:]
    assert launcher.returncode != 0, "the killed run should fail"
    cached = _cached_paths(output)
    assert len(cached) == 1 and cached[0].is_file(), output[-4000:]
    table_bytes = cached[0].read_bytes()
    seen = _losses(run_dir)
    assert EVERY in seen and STEPS not in seen, f"the kill should land between steps {EVERY} and {STEPS}: {seen}"
    assert [c.step for c in committed_checkpoints(open_storage(run_dir / "checkpoints"))] == [EVERY]

    # 2. The same command again: it resumes from step 10 and reads the table instead of scoring again.
    resumed = nxdt(*killed, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, _output(resumed)[-4000:]
    assert "resumed from" in _output(resumed) and SCORED not in _output(resumed), _output(resumed)[-4000:]
    assert cached[0].read_bytes() == table_bytes

    # 3. A run never interrupted (its own results, the same data cache) has the same losses, bit for bit.
    straight = nxdt(*overrides(tmp_path / "straight"), cwd=tmp_path, timeout=600)
    assert straight.returncode == 0 and SCORED not in _output(straight), _output(straight)[-4000:]
    expected, got = _losses(tmp_path / "straight" / "llama_tiny_dpo" / "alignment"), _losses(run_dir)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]

    # 4. A damaged table is named, recomputed and written again, the same bytes as before.
    damaged = bytearray(table_bytes)
    damaged[-8:] = bytes(8)
    cached[0].write_bytes(bytes(damaged))
    again = nxdt(*overrides(tmp_path / "again", "trainer.max_steps=2", "model.optim.sched.warmup_steps=1"),
                 cwd=tmp_path, timeout=600)
    assert again.returncode == 0, _output(again)[-4000:]
    assert f"warning: {cached[0]}: the reference log-probs do not match their checksum" in _output(again)
    assert _cached_paths(_output(again)) == cached, _output(again)[-4000:]
    assert cached[0].read_bytes() == table_bytes
    np.testing.assert_array_equal(np.load(cached[0]), np.load(io.BytesIO(table_bytes)))


def test_orpo_trains_from_the_same_data(preference_data, tmp_path):
    result = nxdt("cluster_type=local", "stages=[alignment]", "alignment=llama/tiny_orpo",
                  f"data_dir={preference_data}", f"base_results_dir={tmp_path}/results",
                  *_stage("trainer.max_steps=10", "trainer.val_check_interval=10", "trainer.limit_val_batches=2",
                          "model.optim.sched.warmup_steps=2"),
                  cwd=tmp_path, timeout=600)
    output = _output(result)
    assert result.returncode == 0, output[-4000:]
    assert SCORED not in output, "ORPO needs no reference"
    rows = _rows(tmp_path / "results" / "llama_tiny_orpo" / "alignment")
    train = [row for row in rows if "loss" in row]
    assert [row["step"] for row in train] == list(range(1, 11)), rows
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["chosen_nll"]) for row in train), train
    assert train[-1]["chosen_nll"] < train[0]["chosen_nll"], "the SFT half of the loss learns"
    assert rows[-1]["step"] == 10 and math.isfinite(rows[-1]["val_loss"]), rows[-1]


@pytest.mark.slurm
@pytest.mark.long("DPO as real Slurm jobs on two nodes, references computed first")
def test_dpo_on_two_slurm_nodes(slurm_cluster, tmp_path):
    results = tmp_path / "results"
    result = nxdt("cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", f"base_results_dir={results}",
                  f"data_dir={tmp_path}/data", "stages=[data_preparation,alignment]",
                  "data_preparation=preference_demo", "data_preparation.synthetic_preferences.num_train=400",
                  "data_preparation.synthetic_preferences.num_valid=32", "alignment=llama/tiny_dpo",
                  "alignment.trainer.num_nodes=2",
                  *_stage("trainer.devices=1", "trainer.max_steps=6", "trainer.val_check_interval=3",
                          "trainer.limit_val_batches=2", "model.optim.sched.warmup_steps=1"),
                  cwd=tmp_path, env=slurm_cluster.env)
    assert result.returncode == 0, _output(result)
    record = json.loads((results / "llama_tiny_dpo" / "launch.json").read_text())
    states = [slurm_cluster.wait_job(str(s["job_id"]), 600) for s in record["stages"]]
    logs = nxdt("logs", "llama_tiny_dpo", "--results-dir", str(results), env=slurm_cluster.env).stdout
    assert states == ["COMPLETED"] * 2, logs[-4000:]
    assert len(sorted((results / "llama_tiny_dpo" / "alignment" / "logs").glob("*_node*.log"))) == 2
    assert "dp=0/2" in logs and "400 train pairs " + SCORED in logs, logs[-3000:]
    rows = _rows(results / "llama_tiny_dpo" / "alignment")
    train = [row for row in rows if "loss" in row]
    assert [row["step"] for row in train] == list(range(1, 7)) and train[0]["reward_accuracy"] == 0.0, train
    assert all(0.0 <= row["reward_accuracy"] <= 1.0 for row in train), train
    assert rows[-1]["step"] == 6 and "val_reward_accuracy" in rows[-1], rows[-2:]
