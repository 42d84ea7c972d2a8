"""Every user mistake: one `error:` line per problem naming the key, exit code 2, no traceback, and nothing
written or submitted. Run through the real CLI in a fresh process, as a user would meet it."""

import pytest

from .helpers import nxdt

CASES = [
    # (overrides, text the error line must contain)
    (["training.trainer.num_nodes=1", "training.trainer.devices=3", "training.model.tensor_model_parallel_size=2"],
     "num_nodes × devices = 1 × 3 = 3 is not divisible by tensor_model_parallel_size × pipeline_model_parallel_size = 2 × 1 = 2"),
    (["training.model.global_batch_size=10", "training.model.micro_batch_size=4"],
     "training.model.global_batch_size: 10 is not divisible by micro_batch_size × data-parallel size = 4 × 2 = 8"),
    (["training.model.num_attention_heads=6", "training.model.hidden_size=120", "training.model.tensor_model_parallel_size=4",
      "training.trainer.devices=4", "training.model.global_batch_size=4"],
     "training.model.num_attention_heads: 6 is not divisible by tensor_model_parallel_size 4"),
    (["training.model.num_layers=5", "training.model.pipeline_model_parallel_size=2"],
     "training.model.num_layers: 5 is not divisible by pipeline_model_parallel_size × virtual_pipeline_model_parallel_size = 2 × 1 = 2"),
    (["training.model.num_layers=4", "training.model.pipeline_model_parallel_size=2",
      "training.model.virtual_pipeline_model_parallel_size=4", "training.model.global_batch_size=8"],
     "= 2 × 4 = 8"),
    (["training.model.tensor_model_paralel_size=2"],
     "unknown key 'training.model.tensor_model_paralel_size': did you mean 'training.model.tensor_model_parallel_size'?"),
    (["training=gpt3/tny"], "training=gpt3/tny: no such choice; did you mean 'gpt3/tiny'? valid choices: "),
    (["cluster=pcluster_trn"], "cluster=pcluster_trn: no such choice; did you mean 'pcluster_trn"),
    (["cluster.partiton=x"], "unknown key 'cluster.partiton': did you mean 'cluster.partition'? valid keys under cluster: account,"),
    (["+cluster.constraint=a100"], "cluster.constraint: unknown key; valid keys: partition, account, exclusive"),
    (["cluster.partition='a b'"], "cluster.partition: 'a b' is not a Slurm value"),
    (["stages=[training,finetune]"], "stages: unknown stage 'finetune'; valid stages: data_preparation, training"),
    (["stages=[training", ], "override 'stages=[training' is not valid Hydra syntax"),
    (["training.run.time_limit=tomorrow"], "training.run.time_limit: 'tomorrow' is not a Slurm time"),
    (["training.run.dependency=afterwards"], "training.run.dependency: 'afterwards' is not one of afterok, afterany, singleton"),
    (["training.run.preemption_signal_s=-5"], "training.run.preemption_signal_s: -5 must be whole seconds from 0 to 65535"),
    (["training.run.preemption_signal_s=1800"],
     "training.run.preemption_signal_s: 1800 s is not shorter than run.time_limit 0:30:00 (1800 s)"),
    (["training.run.max_restarts=-1"], "training.run.max_restarts: -1 must be an integer >= 0"),
    (["training.run.max_restarts=often"], "training.run.max_restarts: 'often' is not an integer"),
    (["training.precision.type=fp8"], "training.precision.type: 'fp8' is not one of fp32, bf16SR, mixed_precision"),
    (["training.trainer.max_steps=10"], "training.model.optim.sched.warmup_steps: warmup_steps 15 + constant_steps 0 exceeds trainer.max_steps 10"),
    (["training.model.architecture=mamba"], "training.model.architecture: 'mamba' is not one of gpt, llama"),
    (["cluster_type=kubernetes"], "cluster_type: 'kubernetes' is not one of auto, local, slurm, bcm"),
    (["run_name='my run'"], "run_name: 'my run' must be non-empty, without '/', spaces"),
    (["base_results_dir=relative/dir"], "base_results_dir: 'relative/dir' must be an absolute path"),
    (["env_vars.A-B=x"], "env_vars.A-B: 'A-B' is not a valid environment variable name"),
    (["env_vars.1BAD=x"], "override 'env_vars.1BAD=x' is not valid Hydra syntax (Error parsing override 'env_vars.1BAD=x')"),
    (["container=img:latest", "cluster_type=local"], "container: the local executor runs this machine's Python"),
    (["stages=[training]", "data_dir=/nonexistent/data"],
     "training.model.tokenizer.model: /nonexistent/data/demo/tokenizer.json does not exist"),
]


@pytest.mark.parametrize("overrides,expected", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, overrides, expected):
    results = tmp_path / "results"
    result = nxdt(f"base_results_dir={results}", "cluster_type=local", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    assert any(expected in line for line in lines), result.stderr
    assert not results.exists(), "a rejected launch wrote files"
    assert not list(tmp_path.iterdir()), "a rejected launch wrote files"


def test_missing_paths_are_warnings_in_a_dry_run(tmp_path):
    result = nxdt(f"base_results_dir={tmp_path}/results", "stages=[training]", "data_dir=/nonexistent",
                  "cluster_type=slurm", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning: training.model.tokenizer.model: /nonexistent/demo/tokenizer.json does not exist" in result.stdout
