"""The rl stage under pipeline parallelism: rl=demo rendered at pipeline_model_parallel_size 2 on 2 workers (its 2
layers, one a stage; data-parallel 1), its ranks forked from this process (tests/checkpoint/launch_helpers), trains
STEPS steps whose rollouts (generated through both stages), rewards, KL toward the frozen reference (beta > 0, the
reference split into the same stages), losses and held-out greedy reward equal a 1-worker run's of the same
config."""
from __future__ import annotations

import json

import pytest

from runtime.rl.synthetic import write_demo
from tests.checkpoint.launch_helpers import train_rendered
from tests.launcher.helpers import nxdt

STEPS = 3
PER_STEP = ("loss", "grad_norm", "reward", "kl", "reward_std", "completion_length", "clip_ratio", "frac_reward_zero_std")


def _train(work, data, name: str, *overrides: str) -> list[dict]:
    """rl=demo rendered for this machine (--dry-run) into work/NAME and trained here; returns its metrics rows."""
    result = nxdt("cluster_type=local", "stages=[rl]", "rl=demo", f"data_dir={data}",
                  f"base_results_dir={work}/{name}", "rl.trainer.log_every_n_steps=1", "rl.trainer.preflight=false",
                  "rl.exp_manager.create_tensorboard_logger=false", "rl.exp_manager.create_metrics_plot=false",
                  f"rl.trainer.max_steps={STEPS}", f"rl.trainer.val_check_interval={STEPS}",
                  "rl.trainer.limit_val_batches=1", "rl.grpo.beta=0.04", *overrides, "--dry-run", cwd=work)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stage = work / name / "rl_demo" / "rl"
    assert set(train_rendered(stage / "rl_config.yaml", "rl")) == {0}
    assert f"pipeline_model_parallel_size: {2 if name == 'pp2' else 1}\n" in (stage / "rl_config.yaml").read_text()
    return [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines() if line]


def test_two_pipeline_stages_train_what_one_worker_does(tmp_path):
    data = tmp_path / "data"
    write_demo(data / "rl_demo")
    pipelined = _train(tmp_path, data, "pp2", "rl.trainer.devices=2", "rl.model.pipeline_model_parallel_size=2")
    whole = _train(tmp_path, data, "one", "rl.trainer.devices=1")
    steps = [[row for row in rows if "loss" in row] for rows in (pipelined, whole)]
    assert [row["step"] for row in steps[0]] == [row["step"] for row in steps[1]] == list(range(1, STEPS + 1))
    for got, expected in zip(*steps):
        for key in PER_STEP:
            assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6), (got["step"], key)
        assert got["kl"] > 0 or got["step"] == 1  # the policy has left the reference after its first update
    held_out = [[row["val_reward"] for row in rows if "val_reward" in row] for rows in (pipelined, whole)]
    assert len(held_out[0]) == 1 and held_out[0] == pytest.approx(held_out[1], abs=1e-6)
