"""`nxdt-launch cluster-validate` on the real 3-node Slurm of tests/slurm_cluster.py, pinned to node1 and node2
(cluster.nodelist): a healthy run passes on both nodes and reports every measurement; a node whose shared file
system is missing is named, and the override written for it keeps it out of the next launch's sbatch script."""

import json
import sys

import pytest

from tests.launcher.helpers import nxdt

pytestmark = pytest.mark.slurm

# Stand-in interpreter: the real Python, except on $HIDE_ON_NODE, where $HIDE_PATH is covered by an empty tmpfs
# in a private mount namespace, as if the shared file system were not mounted on that node.
WRAPPER = """#!/bin/bash
if [ "$SLURMD_NODENAME" = "${{HIDE_ON_NODE:-}}" ]; then
  exec unshare --mount --propagation private bash -c 'mount -t tmpfs nxdt-hidden "$0" && exec "$@"' \\
    "$HIDE_PATH" {python} "$@"
fi
exec {python} "$@"
"""

QUICK = ["collectives.max_bytes=64K", "collectives.iters=5", "collectives.warmup_iters=2",
         "register_timeout_s=60", "task_timeout_s=120", "env_vars.GLOO_SOCKET_IFNAME=lo"]


def validate(slurm_cluster, tmp_path, *overrides):
    (tmp_path / "data").mkdir(exist_ok=True)
    return nxdt("cluster-validate", "cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}",
                f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", *QUICK, *overrides,
                cwd=tmp_path, env=slurm_cluster.env, timeout=300)


def report_of(tmp_path) -> dict:
    return json.loads((tmp_path / "results/cluster_validation/cluster_validation/cluster_validation.json").read_text())


def test_both_nodes_pass_with_every_measurement_reported(slurm_cluster, tmp_path):
    result = validate(slurm_cluster, tmp_path, "cluster.nodelist=[node1,node2]", "devices=2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert "all 2 node(s) passed" in result.stdout
    for text in ("health · node1", "health · node2", "busbw(GB/s)", "all_nodes · node1,node2 · 4 ranks · gloo"):
        assert text in result.stdout, text

    report = report_of(tmp_path)
    assert report["passed"] and report["bad_nodes"] == [] and report["exclude_override"] == "cluster.exclude=[]"
    assert sorted(report["verdicts"]) == ["node1", "node2"]
    for node in ("node1", "node2"):
        statuses = {c["name"]: c["status"] for c in report["health"][node]}
        assert statuses["versions"] == "pass" and statuses["clock"] == "pass"
        assert statuses["efa"] == "n/a" and statuses["accelerator"] == "n/a", "absent tools are n/a, never pass"
    phases = [(t["phase"], tuple(t["group"])) for t in report["tests"]]
    assert ("intra_node", ("node1",)) in phases and ("intra_node", ("node2",)) in phases
    assert ("pair", ("node1", "node2")) in phases and ("all_nodes", ("node1", "node2")) in phases
    final = next(t for t in report["tests"] if t["phase"] == "all_nodes")
    sizes = report["sizes"]
    assert len(final["rows"]) == 5 * len(sizes) and all(r["wrong"] == 0 and r["busbw"] > 0 for r in final["rows"])


def test_a_node_without_the_shared_file_system_is_named_and_excluded_next_time(slurm_cluster, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    python = tmp_path / "python"
    python.write_text(WRAPPER.format(python=sys.executable))
    python.chmod(0o755)
    result = validate(slurm_cluster, tmp_path, "cluster.nodelist=[node1,node2]", f"python={python}",
                      "env_vars.HIDE_ON_NODE=node2", f"env_vars.HIDE_PATH={shared}", f"health.shared_paths=[{shared}]")
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr
    assert "1 bad node(s): node2" in result.stdout and "cluster.exclude=[node2]" in result.stdout, \
        result.stdout[-4000:] + result.stderr

    report = report_of(tmp_path)
    assert report["bad_nodes"] == ["node2"]
    assert any(r.startswith(f"shared {shared}:") for r in report["verdicts"]["node2"]["reasons"])
    override = (tmp_path / "results/cluster_validation/cluster_validation/exclude_override.txt").read_text().strip()
    assert override == "cluster.exclude=[node2]"

    launch = nxdt("stages=[training]", "cluster_type=slurm", f"base_results_dir={tmp_path}/results",
                  f"data_dir={tmp_path}/data", override, "--dry-run", cwd=tmp_path, env=slurm_cluster.env)
    assert launch.returncode == 0, launch.stderr
    sbatch = (tmp_path / "results/gpt3_tiny/training/training.sbatch").read_text()
    assert "#SBATCH --exclude=node2\n" in sbatch
