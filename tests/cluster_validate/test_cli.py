"""`nxdt-launch cluster-validate` as a user runs it (no Slurm needed): mistakes are one line and exit 2, a dry
run renders one job over the requested nodes, and a local run validates this machine."""

import json

import pytest
import yaml

from launcher import validate
from launcher.config import parse_cluster
from launcher.commands.cluster_validate import expand_hostlist
from tests.cluster_validate.conftest import agent_here
from tests.launcher.helpers import nxdt


def test_mistakes_are_one_line_each_and_exit_2(tmp_path):
    result = nxdt("cluster-validate", "devices=0", "collectives.operations=[all_reduce,allreduce]",
                  "cluster.exclude='node[1-'", f"base_results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and all(line.startswith("error: ") for line in lines)
    assert any("cluster_validation.devices: 0 must be a positive integer" in line for line in lines)
    assert any("unknown operation 'allreduce'" in line for line in lines)
    assert any(line.startswith("error: cluster.exclude: 'node[1-': a '[' is never closed") for line in lines)
    typo = nxdt("cluster-validate", "collectives.max_byts=1M", cwd=tmp_path)
    assert typo.returncode == 2 and "did you mean 'cluster_validation.collectives.max_bytes'" in typo.stderr


def test_dry_run_renders_one_job_over_the_node_list(tmp_path):
    result = nxdt("cluster-validate", "cluster_type=slurm", "cluster.nodelist=['node[1-3]']", "cluster.partition=trn1",
                  f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}", "devices=32",
                  "accelerator=neuron", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job_dir = tmp_path / "results/cluster_validation/cluster_validation"
    sbatch = (job_dir / "cluster_validation.sbatch").read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --nodelist=node[1-3]", "#SBATCH --partition=trn1",
                 "#SBATCH --ntasks-per-node=1"):
        assert line + "\n" in sbatch, line
    assert f"-m csp_tools.cluster_validate --config {job_dir}/cluster_validation_config.yaml" in sbatch
    assert "torch.distributed.run" not in sbatch, "one agent per node; it starts the workers itself"
    assert not (job_dir / "cluster_validation.json").exists()


@pytest.mark.parametrize("cluster, workers", [("pcluster_trn1", 32), ("pcluster_trn1n", 32), ("pcluster_trn2", 64)])
def test_a_trainium_cluster_validates_its_neuron_cores_with_no_further_flags(tmp_path, cluster, workers):
    """The cluster decides the hardware (launcher/targets.py): Neuron workers, nccom-test and the EFA environment
    the training script exports, without accelerator= or devices=."""
    result = nxdt("cluster-validate", f"cluster={cluster}", "cluster_type=slurm", "cluster.nodelist=['trn[1-2]']",
                  f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job_dir = tmp_path / "results/cluster_validation/cluster_validation"
    config = yaml.safe_load((job_dir / "cluster_validation_config.yaml").read_text())
    assert (config["accelerator"], config["devices"]) == ("neuron", workers)
    assert config["nccom_test"]["enabled"] == "auto"
    sbatch = (job_dir / "cluster_validation.sbatch").read_text()
    assert "export FI_PROVIDER=efa\n" in sbatch and "export FI_EFA_USE_DEVICE_RDMA=1\n" in sbatch


def test_a_plain_slurm_cluster_validates_one_cpu_worker(tmp_path):
    """The counterpart of the Trainium clusters above (once, not once per Trainium cluster): cluster=slurm decides
    CPU workers, one per node."""
    plain = nxdt("cluster-validate", "cluster=slurm", "cluster_type=slurm", "cluster.nodelist=['n[1-2]']",
                 f"base_results_dir={tmp_path}/plain", f"data_dir={tmp_path}", "--dry-run", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    config = yaml.safe_load((tmp_path / "plain/cluster_validation/cluster_validation/cluster_validation_config.yaml")
                            .read_text())
    assert (config["accelerator"], config["devices"]) == ("cpu", 1)


def test_local_run_validates_this_machine_and_show_prints_it_again(tmp_path):
    (tmp_path / "data").mkdir()
    args = ["cluster_type=local", f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data",
            "devices=2", "collectives.max_bytes=16K", "collectives.iters=3", "collectives.warmup_iters=1"]
    result = nxdt("cluster-validate", *args, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    report = json.loads((tmp_path / "results/cluster_validation/cluster_validation/cluster_validation.json")
                        .read_text())
    assert report["passed"] and len(report["verdicts"]) == 1
    (test,) = report["tests"]
    assert test["phase"] == "intra_node" and test["ranks"] == 2 and all(r["wrong"] == 0 for r in test["rows"])
    shown = nxdt("cluster-validate", "--show", *args, cwd=tmp_path)
    assert shown.returncode == 0 and "all 1 node(s) passed" in shown.stdout and "busbw(GB/s)" in shown.stdout


def test_a_check_every_node_fails_is_named_as_the_config_not_excluded(tmp_path):
    """data_dir missing on every node: the fix is the config, so the report excludes nobody and says so. One
    device: a node that fails its checks runs no collective test (the same report with two), and its worker pool
    starts a process importing torch per device. The launcher renders the run (--dry-run); the command of its
    script runs forked from this process (agent_here: the local launch itself is the test above's)."""
    args = ["cluster_type=local", f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/no_such_data",
            "devices=1", "collectives.max_bytes=16K", "collectives.iters=3", "collectives.warmup_iters=1"]
    rendered = nxdt("cluster-validate", *args, "--dry-run", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stdout[-3000:] + rendered.stderr
    job_dir = tmp_path / "results/cluster_validation/cluster_validation"
    config = job_dir / "cluster_validation_config.yaml"
    script = (job_dir / "cluster_validation.local.sh").read_text().strip().splitlines()[-1]
    assert script == f'"$PYTHON" -m csp_tools.cluster_validate --config {config}', script
    assert agent_here(config).returncode != 0
    report = json.loads((job_dir / "cluster_validation.json").read_text())
    assert report["bad_nodes"] and report["exclude_override"] == "cluster.exclude=[]"
    [note] = [n for n in report["notes"] if n.startswith("every node fails the same check")]
    assert f"path {tmp_path}/no_such_data: does not exist" in note and "fix it rather than excluding" in note


@pytest.mark.parametrize("expression,names", [
    ("node[1-8]", [f"node{i}" for i in range(1, 9)]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a,b", ["a", "b"]),
    ("node[1-2],gpu[08-10]", ["node1", "node2", "gpu08", "gpu09", "gpu10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("head", ["head"]),
])
def test_slurm_hostlists_expand_as_slurm_does(expression, names):
    assert expand_hostlist(expression) == names


@pytest.mark.parametrize("expression,why", [("node[a-3]", "'a-3' is not a number"), ("node[1-", "never closed"),
                                            ("node[3-1]", "runs backwards"), ("a,,b", "empty node name"),
                                            ("n[[1]]", "do not nest")])
def test_a_hostlist_slurm_would_refuse_is_one_line_naming_the_key(expression, why):
    cluster = {"nodelist": expression}
    (error,) = validate.cluster(parse_cluster(cluster))
    assert error.startswith("cluster.nodelist: ") and why in error, error


def test_a_hostlist_string_is_taken_where_a_node_list_is_expected(tmp_path):
    """docs/cluster_validation.md: cluster.nodelist='node[1-8]' is eight nodes, not a refused non-list."""
    result = nxdt("cluster-validate", "cluster_type=slurm", "cluster.nodelist='node[01-03,7]'",
                  "cluster.exclude='node9,node10'", f"base_results_dir={tmp_path}/results", "devices=2", "--dry-run",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "on 4 node(s)" in result.stdout
    sbatch = (tmp_path / "results/cluster_validation/cluster_validation/cluster_validation.sbatch").read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --nodelist=node[01-03,7]", "#SBATCH --exclude=node9,node10"):
        assert line + "\n" in sbatch, line
