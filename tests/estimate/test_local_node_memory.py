"""A CPU run on the local executor is judged against this machine's memory (its total, not what is free now: the
check is per launch, and launches side by side, as xdist's, each get the same answer): one that needs more is
refused in one line with the arithmetic, the key and the fix, and nothing is written. cluster.node_memory_gib, when
given, is the node's memory instead; a CPU run on Slurm without it is not judged (this machine's memory says
nothing of a Slurm node's)."""

from launcher.estimator.hardware import GIB, host_memory_bytes
from tests.launcher.helpers import nxdt, refused

# The tiny GPT recipe widened to GPT-3 175B's shape: over 4 TiB of host memory for each of its two CPU workers
# (weights, gradients, Adam moments and the checkpoint's copy, in fp32), more than any one machine has; the
# estimator sizes it by arithmetic, so nothing that size is ever allocated.
BEYOND_ANY_MACHINE = ["training.model.num_layers=96", "training.model.hidden_size=12288",
                      "training.model.num_attention_heads=96"]


def _launch(tmp_path, data_dir, *overrides: str):
    return nxdt("stages=[training]", "training=gpt3/tiny", f"base_results_dir={tmp_path}/results",
                f"data_dir={data_dir}", *overrides, cwd=tmp_path)


def test_a_local_run_beyond_this_machines_memory_is_refused_with_nothing_written(tmp_path, recipe_data_dir):
    result = _launch(tmp_path, recipe_data_dir, "cluster_type=local", *BEYOND_ANY_MACHINE)
    (line,) = refused(result, "training.model: host memory per node by the estimator: 2 workers × ")
    machine = host_memory_bytes() / GIB
    assert f"usable of {machine:g} GiB (this machine); raise training.model.tensor_model_parallel_size" in line, line
    assert "set cluster.node_memory_gib if the nodes have more" in line
    assert list(tmp_path.iterdir()) == []


def test_a_stated_node_memory_is_the_way_out_and_slurm_nodes_are_not_this_machine(tmp_path, recipe_data_dir):
    stated = _launch(tmp_path, recipe_data_dir, "cluster_type=local", "cluster.node_memory_gib=65536", "--dry-run",
                     *BEYOND_ANY_MACHINE)
    assert stated.returncode == 0, stated.stderr
    assert "GiB usable of 65536 GiB (cluster.node_memory_gib)" in " ".join(stated.stdout.split()), stated.stdout
    on_slurm = _launch(tmp_path, recipe_data_dir, "cluster_type=slurm", "--dry-run", *BEYOND_ANY_MACHINE)
    assert on_slurm.returncode == 0, on_slurm.stderr


def test_the_default_pipelines_training_fits_this_machine(tmp_path, recipe_data_dir):
    """The tiny GPT's two workers, as the README's default pipeline launches them here: judged, and well within a
    laptop's or CI's memory (2 cores, 24 GiB)."""
    result = _launch(tmp_path, recipe_data_dir, "cluster_type=local", "--dry-run")
    assert result.returncode == 0, result.stderr
    note = " ".join(result.stdout.split())
    assert "host memory per node (training): 2 workers × " in note and "(this machine)" in note, note
