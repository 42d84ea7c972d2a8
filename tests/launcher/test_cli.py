"""The CLI as a user meets it: help, --version, a mistyped command, the 175B dry run the issue names, and a dry run
that never imports torch."""

import os
import subprocess
import sys

import pytest
import yaml

from .helpers import REPO, nxdt


def test_help_lists_commands_and_every_group_with_its_choices():
    result = nxdt("--help")
    assert result.returncode == 0
    for command in ("status", "logs", "cancel"):
        assert command in result.stdout
    training = next(line for line in result.stdout.splitlines() if line.strip().startswith("training:"))
    assert all(recipe in training for recipe in ("gpt3/tiny", "llama/tiny", "gpt3/175b", "llama3/8b", "llama3_1/70b"))
    assert "autoconfig" in result.stdout and "cluster-validate" in result.stdout
    assert ("cluster: eks_trn1, eks_trn2, hyperpod_eks, local, pcluster_trn1, pcluster_trn1n, pcluster_trn2, slurm"
            in result.stdout)


def test_175b_dry_run_writes_a_valid_sbatch_that_matches_the_recipe(tmp_path):
    result = nxdt("stages=[training]", "training=gpt3/175b", "cluster_type=slurm", "--dry-run",
                  f"base_results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = tmp_path / "gpt3_175b" / "training" / "training.sbatch"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --nodes=128\n" in text
    assert "#SBATCH --ntasks-per-node=1\n" in text
    assert '--nnodes 128 --node_rank "$SLURM_NODEID" --nproc_per_node 8' in text
    # training_config.yaml links to the launch's own copy (launches/<id>/), which the job reads.
    launched = script.parent / os.readlink(script.parent / "training_config.yaml")
    assert launched.parent.parent == script.parent / "launches"
    assert f"-m runtime.train --config {launched}" in text
    stage = yaml.safe_load((script.parent / "training_config.yaml").read_text())
    # NeMo-Launcher's published layout: TP 4 x PP 8 with 12 virtual stages per pipeline rank.
    assert stage["model"]["tensor_model_parallel_size"] == 4
    assert stage["model"]["pipeline_model_parallel_size"] == 8
    assert stage["model"]["virtual_pipeline_model_parallel_size"] == 12
    assert stage["model"]["ffn_hidden_size"] == 4 * 12288  # interpolations arrive resolved
    # The plan table: stage, job id, nodes × tasks, dependency, script.
    assert "training" in result.stdout and "dry-run" in result.stdout and "128 × 8" in result.stdout
    assert not (tmp_path / "gpt3_175b" / "launch.json").exists(), "a dry run records no launch"


def test_dry_run_imports_no_torch(tmp_path):
    code = (
        "import sys\n"
        "from launcher.cli import main\n"
        "try:\n"
        f"    main(['stages=[training]', 'training=gpt3/175b', 'cluster_type=slurm', '--dry-run', "
        f"'base_results_dir={tmp_path}'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'boto3', 'paramiko', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_version_prints_the_package_version():
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = nxdt("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"nxdt-launch {declared}"


@pytest.mark.parametrize("argv", [["stats"], ["stats", "gpt3_tiny"], ["cluster_type=local", "stats"],
                                  ["--dry-run", "stats"], ["Status", "gpt3_tiny"]])
def test_a_mistyped_command_is_one_did_you_mean_line(tmp_path, argv):
    result = nxdt(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "did you mean" in lines[0] and "'status'" in lines[0] and "Hydra" not in lines[0], result.stderr
    assert not list(tmp_path.iterdir())
