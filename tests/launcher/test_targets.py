"""The cluster decides the hardware (launcher/targets.py): `training=gpt3/175b` trains neuronx-nemo-megatron's
layout on a trn1 cluster and NeMo's on a GPU one; typed overrides still win; a layout the hardware cannot run is
refused at launch with one line and nothing written. The headline command runs as a user types it."""

import pytest
import yaml

from launcher.errors import UserError
from tests.launcher.helpers import nxdt, resolved

HEADLINE = ["stages=[training]", "training=gpt3/175b", "cluster_type=slurm", "--dry-run"]


def _layout(training: dict) -> tuple:
    trainer, model = training["trainer"], training["model"]
    return (trainer["accelerator"], trainer["devices"], model["tensor_model_parallel_size"],
            model["pipeline_model_parallel_size"], model["virtual_pipeline_model_parallel_size"])


def test_the_headline_command_renders_a_trainium_job_on_trn1_and_nemos_gpu_job_on_slurm(tmp_path):
    trn1 = nxdt(*HEADLINE, "cluster=pcluster_trn1", f"base_results_dir={tmp_path}/r", f"data_dir={tmp_path}/d",
                cwd=tmp_path)
    assert trn1.returncode == 0, trn1.stderr
    job_dir = tmp_path / "r/gpt3_175b_trn1/training"
    stage = yaml.safe_load((job_dir / "training_config.yaml").read_text())
    assert _layout(stage) == ("neuron", 32, 32, 8, None)
    assert stage["model"]["sequence_parallel"] and stage["model"]["micro_batch_size"] == 1
    script = (job_dir / "training.sbatch").read_text()
    for line in ("--nproc_per_node 32", "#SBATCH --partition=trn1", "neuron_parallel_compile",
                 "export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1", "--target=trn1",
                 "NEURON_RT_STOCHASTIC_ROUNDING_EN"):
        assert line in script, line

    gpu = nxdt(*HEADLINE, "cluster=slurm", f"base_results_dir={tmp_path}/g", f"data_dir={tmp_path}/d", cwd=tmp_path)
    assert gpu.returncode == 0, gpu.stderr
    job_dir = tmp_path / "g/gpt3_175b/training"
    stage = yaml.safe_load((job_dir / "training_config.yaml").read_text())
    assert _layout(stage) == ("gpu", 8, 4, 8, 12)
    script = (job_dir / "training.sbatch").read_text()
    assert "--nproc_per_node 8" in script and "neuron" not in script.lower()


def test_trn2_gets_its_own_layout_and_the_cluster_validation_too():
    cfg = resolved("training=gpt3/175b", "cluster=pcluster_trn2")
    assert cfg["training"]["trainer"]["devices"] == 64 and cfg["training"]["trainer"]["accelerator"] == "neuron"
    assert cfg["training"]["run"]["name"] == "gpt3_175b_trn2"
    assert (cfg["cluster_validation"]["accelerator"], cfg["cluster_validation"]["devices"]) == ("neuron", 64)
    assert "targets" not in cfg["training"]


def test_a_typed_override_wins_over_the_targets_layout_and_every_rule_runs_on_the_result():
    cfg = resolved("training=gpt3/175b", "cluster=pcluster_trn1", "training.model.pipeline_model_parallel_size=16",
                   "training.trainer.num_nodes=64")
    assert _layout(cfg["training"]) == ("neuron", 32, 32, 16, None)
    assert cfg["training"]["trainer"]["num_nodes"] == 64


@pytest.mark.parametrize("overrides, message", [
    # A GPU layout forced onto a trn1 cluster.
    (["training=gpt3/175b", "training.trainer.accelerator=gpu"],
     "error: training.trainer.accelerator: 'gpu', but cluster.neuron.hardware is trn1: its nodes have NeuronCores"),
    # A recipe pinned to GPUs (or to trn2's 64 workers) named on a trn1 cluster.
    (["training=llama3/8b_gpu"], "error: training.trainer.accelerator: 'gpu', but cluster.neuron.hardware is trn1"),
    (["training=llama3/8b_trn2"], "error: training.trainer.devices: 64 workers per node, but trn1 nodes have 32"),
    # A tensor-parallel group that would cross a node.
    (["training=gpt3/175b", "training.model.tensor_model_parallel_size=64", "training.trainer.num_nodes=64"],
     "tensor_model_parallel_size: 64 must divide trainer.devices 32"),
    # A layout that does not fit a NeuronCore's memory by the estimator.
    (["training=gpt3/175b", "training.model.pipeline_model_parallel_size=1"],
     "error: training.model: weights, gradients and optimizer state need"),
])
def test_a_layout_the_hardware_cannot_run_is_refused_at_launch_with_one_line(tmp_path, overrides, message):
    result = nxdt("stages=[training]", "cluster=pcluster_trn1", "cluster_type=slurm", "--dry-run", *overrides,
                  f"base_results_dir={tmp_path}/r", f"data_dir={tmp_path}/d", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and all(line.startswith("error: ") for line in lines), lines
    # One line each; TP 64 also splits none of 175B's 96 heads evenly, which is its own line, and 175B's whole
    # layers on each of 32 workers need more host memory than a trn1 node has, also its own line.
    assert len(lines) == 1 or overrides[-1].endswith(("tensor_model_parallel_size=64", "num_nodes=64",
                                                      "pipeline_model_parallel_size=1")), lines
    assert any(message in line for line in lines), lines
    assert not (tmp_path / "r").exists(), "nothing written"


def test_a_target_that_names_no_recipe_is_one_line():
    from omegaconf import OmegaConf

    from launcher import targets

    cfg = OmegaConf.create({"cluster": {"neuron": {"hardware": "trn1"}},
                            "training": {"targets": {"trn1": {"model": {"tensor_model_parallel_size": 8}}}}})
    with pytest.raises(UserError, match=r"training.targets.trn1: .* must name a training recipe"):
        targets.apply(cfg)


@pytest.mark.parametrize("overrides, composes", [
    (["training=gpt3/175b", "cluster=pcluster_trn1"], 1),                                   # trn1's recipe, guessed
    (["training=llama3/8b", "cluster=slurm", "training.model.micro_batch_size=2"], 1),      # its GPU layout, guessed
    (["training=gpt3/175b", "cluster=pcluster_trn1", "cluster.neuron.hardware=trn2"], 3),   # guessed trn1, is trn2
    (["training=gpt3/175b", "cluster=pcluster_trn2", "training.targets=null"], 1),          # pinned here: no guess
    (["training=gpt3/tiny", "cluster=pcluster_trn1"], 1),                                   # no targets to guess
])
def test_the_recipe_read_from_the_files_composes_what_switching_after_composing_does(overrides, composes,
                                                                                     monkeypatch):
    """compose.py composes the recipe targets.guess reads from conf/'s files, once, where it used to compose the
    training recipe and then its target's: the result is the same config, and a guess that the composed config
    contradicts (the hardware overridden) falls back to composing as typed."""
    import hydra

    from launcher import targets

    calls = []
    real = hydra.compose
    from launcher.compose import compose, resolve

    from .helpers import STABLE

    def hydra_resolved():  # compose.py's own path (resolved() composes without Hydra where it can)
        return resolve(compose([*STABLE, *overrides]))

    monkeypatch.setattr(hydra, "compose", lambda *a, **k: calls.append(k["overrides"]) or real(*a, **k))
    guessed = hydra_resolved()
    assert len(calls) == composes, calls
    monkeypatch.setattr(targets, "guess", lambda _: None)
    assert hydra_resolved() == guessed == resolved(*overrides)
