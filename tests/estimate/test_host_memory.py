"""Host memory per node (launcher/estimator/host.py): every worker's own shard, its checkpoint staging, its data and
its process, times the workers of a node, against the node's memory. A layout that needs more is refused at launch
with the arithmetic; no shipped recipe is; `nxdt-launch estimate` prints it; NxD Training's sequential_move_factor
is accepted and changes nothing."""

import dataclasses

import pytest

from launcher import cache
from launcher.config import parse_cluster
from launcher.estimator.hardware import HARDWARE, NODE_MEMORY_GIB, cpu_hardware
from launcher.estimator.host import (BATCH_COPIES, BATCH_FIELDS, DATA_LOADER_FIXED_BYTES, PROCESS_OVERHEAD_BYTES,
                                     USABLE_FRACTION, host_memory)
from launcher.estimator.memory import GRAD_BYTES, MOMENT_BYTES, Kernels, PRECISION_BYTES
from launcher.estimator.shapes import ModelShape, count_parameters
from runtime.schema.facts import CHECKPOINT_CHUNK_BYTES
from tests.estimate.test_estimator import layout
from tests.launcher.helpers import REPO, nxdt, refused
from tests.recipe_data import write_tokenizer

GIB = 2**30


def _llama() -> ModelShape:
    return ModelShape("llama", 4, 1024, 4096, 16, 16, 32000, 1024, 1024, False)


def test_a_worker_holds_its_shard_its_staging_its_batch_and_the_process():
    shape = _llama()
    plan = layout(num_nodes=1, devices_per_node=8, tp=2, pp=1, micro_batch_size=1, global_batch_size=16,
                  precision="mixed_precision", zero1=True, sequence_parallel=False)
    host = host_memory(shape, plan, HARDWARE["trn1"])
    params = count_parameters(shape).total
    # Every parameter's shard: tp 2 halves everything but the replicated norms (a few thousand values).
    shard = host.shard_state
    bytes_ = PRECISION_BYTES["mixed_precision"]
    per_param = bytes_.param + GRAD_BYTES + (MOMENT_BYTES + bytes_.master) / plan.dp
    assert shard == pytest.approx(params / 2 * per_param, rel=0.1)
    # The ring an async save streams what the rank saves through (a quarter of it, in whole chunks).
    saved = params / 2 * (bytes_.param + (MOMENT_BYTES + bytes_.master) / plan.dp)
    assert saved / 4 - CHECKPOINT_CHUNK_BYTES - 0.1 * saved <= host.staging <= saved / 4 * 1.1
    assert host.staging % CHECKPOINT_CHUNK_BYTES == 0
    rows = plan.global_batch_size // plan.dp
    assert host.data_loader == rows * (shape.seq_length + 1) * 8 * BATCH_FIELDS * BATCH_COPIES + DATA_LOADER_FIXED_BYTES
    assert host.process == PROCESS_OVERHEAD_BYTES and host.working == 0
    assert host.per_worker == shard + host.staging + host.data_loader + host.process
    assert host.total == 8 * host.per_worker
    assert host.node_memory_bytes == NODE_MEMORY_GIB["trn1.32xlarge"] * GIB == 512 * GIB
    assert host.usable_bytes == USABLE_FRACTION * 512 * GIB and host.fits
    # More tensor parallelism: smaller shards per worker (though fewer ZeRO-1 ranks), the same workers per node.
    wider = host_memory(shape, dataclasses.replace(plan, tp=4), HARDWARE["trn1"])
    assert wider.shard_state < host.shard_state and wider.workers == host.workers


def test_lora_keeps_only_the_frozen_weights_and_saves_no_base_state():
    shape, plan = _llama(), layout(num_nodes=1, devices_per_node=2, tp=2, pp=1, precision="fp32")
    full = host_memory(shape, plan, HARDWARE["h100"])
    lora = host_memory(shape, plan, HARDWARE["h100"], lora=True)
    assert lora.staging == 0 and lora.shard_state == pytest.approx(full.shard_state * 4 / (4 + 4 + 8), rel=0.05)


def test_on_cpu_the_activations_are_host_memory_too():
    shape, plan = _llama(), layout(num_nodes=1, devices_per_node=2, tp=1, pp=1, precision="fp32")
    host = host_memory(shape, plan, cpu_hardware(2, 16 * GIB), Kernels.for_accelerator(shape, "cpu"))
    assert host.working > 0 and host.per_worker == host.static_per_worker + host.working
    assert host.node == "cluster.node_memory_gib" and host.node_memory_bytes == 16 * GIB


def test_every_shipped_recipe_test_checks_host_memory():
    """Each group's recipe test (which composes every recipe on its intended cluster once) runs
    tests/estimate/host_fit.py's check, the launch's own rule, on it: no shipped recipe needs more host memory than
    its nodes have."""
    for test in ("tests/recipes/test_recipes.py", "tests/launcher/test_fine_tuning_stages.py",
                 "tests/launcher/test_alignment_stages.py"):
        assert "host_memory_problems(" in (REPO / test).read_text(), test


def test_the_trainium_clusters_name_their_instances_memory():
    for cluster, gib in (("pcluster_trn1", 512), ("pcluster_trn1n", 512), ("pcluster_trn2", 2048)):
        assert parse_cluster(cache.resolved([f"cluster={cluster}"])[0]["cluster"]).node_memory_gib == gib


def _launch(tmp_path, data_dir, *overrides):
    return nxdt("stages=[training]", "training=llama3/8b", "cluster=pcluster_trn1", "cluster_type=slurm",
                f"base_results_dir={tmp_path}/results", f"data_dir={data_dir}", *overrides, cwd=tmp_path)


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_layout_beyond_the_nodes_host_memory_is_refused_with_the_arithmetic(dry_run, tmp_path, recipe_data_dir):
    # llama3/8b on trn1: 32 workers × 3.07 GiB = 98.4 GiB, on a made-up 64 GiB node.
    result = _launch(tmp_path, recipe_data_dir, "cluster.node_memory_gib=64", *(["--dry-run"] if dry_run else []))
    (line,) = refused(result, "training.model: host memory per node by the estimator: 32 workers × 3.07 GiB = "
                              "98.4 GiB vs 57.6 GiB usable of 64 GiB (cluster.node_memory_gib); raise "
                              "training.model.tensor_model_parallel_size or pipeline_model_parallel_size")
    assert "lower training.trainer.devices" in line and "set cluster.node_memory_gib" in line
    assert not (tmp_path / "results").exists()
    # A node with enough (98.4 of 0.9 x 160 = 144 GiB) takes the same layout.
    fits = _launch(tmp_path, recipe_data_dir, "cluster.node_memory_gib=160", "--dry-run")
    assert fits.returncode == 0, fits.stderr
    # The launch prints the stage's host memory per node, as it judged it.
    assert ("host memory per node (training): 32 workers × 3.07 GiB = 98.4 GiB vs 144.0 GiB usable of 160 GiB "
            "(cluster.node_memory_gib)") in " ".join(fits.stdout.split()), fits.stdout


def test_a_fine_tuning_stage_is_judged_too(tmp_path):
    from launcher import launch
    from launcher.errors import UserError

    # The vocabulary is the tokenizer's (the weights and chat data need not be here for a dry run).
    (tmp_path / "hf" / "Meta-Llama-3-8B").mkdir(parents=True)
    write_tokenizer(tmp_path / "hf" / "Meta-Llama-3-8B" / "tokenizer.json", 128256)
    with pytest.raises(UserError) as caught:
        launch.make_plan(["stages=[fine_tuning]", "fine_tuning=llama3/8b", "cluster=pcluster_trn1",
                          "cluster_type=slurm", "cluster.node_memory_gib=16", f"base_results_dir={tmp_path}/r",
                          f"data_dir={tmp_path}"], dry_run=True, produced_by="test")
    assert any(p.startswith("fine_tuning.model: host memory per node by the estimator: 32 workers × ")
               for p in caught.value.problems), caught.value.problems


# Not positive, and not a number (-1 and true take the same two paths).
@pytest.mark.parametrize("value", ["0", "lots"])
def test_the_node_memory_key_takes_a_positive_number(value, tmp_path, recipe_data_dir):
    refused(_launch(tmp_path, recipe_data_dir, f"cluster.node_memory_gib={value}", "--dry-run"),
            "cluster.node_memory_gib: ")
    refused(nxdt("estimate", "training=llama3/8b", f"cluster.node_memory_gib={value}"),
            "cluster.node_memory_gib: ")


def test_estimate_prints_host_memory_per_node_next_to_the_device():
    result = nxdt("estimate", "training=llama3/8b", "cluster=pcluster_trn1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.index("memory per device") < out.index("host memory per node (32 workers")
    for part in ("shard state", "checkpoint staging", "data loader", "process (torch + runtime, 256 MiB measured)",
                 "32 workers × 3.07 GiB = 98.4 GiB vs 460.8 GiB usable of 512 GiB (trn1.32xlarge): fits"):
        assert part in out, part
    small = nxdt("estimate", "training=llama3/8b", "cluster=pcluster_trn1", "--node-memory-gib", "64")
    assert "vs 57.6 GiB usable of 64 GiB (cluster.node_memory_gib): does not fit" in small.stdout


# ---- NxD Training's trainer.sequential_move_factor ----------------------------------------------------------

NXD_FILE = REPO / "tests" / "fixtures" / "nxdt" / "hf_llama3_8B_config.yaml"


def _nxd_with_move_factor(tmp_path, value: str):
    text = NXD_FILE.read_text()
    assert "\ntrainer:\n" in text
    file = tmp_path / "nxd.yaml"
    file.write_text(text.replace("\ntrainer:\n", f"\ntrainer:\n  sequential_move_factor: {value}\n", 1))
    return file, nxdt("stages=[training]", f"training=@{file}", "cluster=pcluster_trn1", "cluster_type=slurm",
                      f"base_results_dir={tmp_path}/results", "data_dir=/data", "--dry-run", cwd=tmp_path)


def test_nxd_sequential_move_factor_is_accepted_and_changes_nothing(tmp_path):
    file, result = _nxd_with_move_factor(tmp_path, "11")
    assert result.returncode == 0, result.stderr
    assert "trainer.sequential_move_factor" in result.stdout + result.stderr  # named among the keys ignored
    # The launch is the same whatever the factor, and the same as without it.
    from launcher import launch

    def composed(folder: str, text: str) -> dict:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same.yaml").write_text(text)
        return launch.make_plan(["stages=[training]", f"training=@{tmp_path / folder / 'same.yaml'}",
                                 "cluster=pcluster_trn1", "cluster_type=slurm", "base_results_dir=/results",
                                 "data_dir=/data"], dry_run=True, produced_by="test").cfg

    assert composed("with", file.read_text()) == composed("without", NXD_FILE.read_text())
    explained = nxdt("explain-config", str(file))
    assert "bounds nothing" in explained.stdout


@pytest.mark.parametrize("value", ["0", '"x"'])
def test_nxd_sequential_move_factor_must_be_a_positive_integer(value, tmp_path):
    file, result = _nxd_with_move_factor(tmp_path, value)
    (line,) = refused(result, f"training=@{file}: trainer.sequential_move_factor: ")
    assert "must be a positive integer" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nxd.yaml"]


def test_the_peer_copies_count_in_host_memory_and_are_stated_at_launch(tmp_path, recipe_data_dir):
    """fault_tolerance.peer_state_every_n_steps (docs/fault_tolerance.md): per worker a host copy of its saved state
    and its share of the node's peer store (two nodes' copies, each twice): the same layout that fits 160 GiB
    without them does not with them, and on trn1's 512 GiB the launch states what they take."""
    peer = "training.fault_tolerance.peer_state_every_n_steps=1"
    (line,) = refused(_launch(tmp_path, recipe_data_dir, "cluster.node_memory_gib=160", peer, "--dry-run"),
                      "training.model: host memory per node by the estimator: 32 workers × ")
    assert "vs 144.0 GiB usable of 160 GiB" in line, line
    fits = _launch(tmp_path, recipe_data_dir, peer, "--dry-run")
    assert fits.returncode == 0, fits.stderr
    note = " ".join(fits.stdout.split())
    assert "peer-held state every 1 step(s): " in note and " GiB per node in its peer store and " in note, note
