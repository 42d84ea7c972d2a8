"""The local three-node Slurm cluster behaves like the real clusters the launcher targets.

Runs against real slurmctld/slurmd daemons (csp_tools/local_slurm), so it checks the behaviour the launcher
relies on, including Slurm 22.05's answer to an afterok dependency on a failed job.
"""

from __future__ import annotations

import subprocess
import time

import pytest

pytestmark = pytest.mark.slurm


def _run(cluster, *argv: str, cwd=None) -> str:
    return subprocess.run(
        argv, env=cluster.env, cwd=cwd, capture_output=True, text=True, check=True, timeout=60
    ).stdout


def _sbatch(cluster, tmp_path, script: str, *options: str) -> str:
    (tmp_path / "job.sh").write_text("#!/bin/bash\n" + script + "\n")
    out = _run(cluster, "sbatch", "--parsable", "-o", str(tmp_path / "slurm-%j.out"), *options,
               str(tmp_path / "job.sh"), cwd=tmp_path)
    return out.strip().split(";")[0]


def _wait_record(cluster, job_id: str, condition, timeout: float = 20.0) -> dict[str, str]:
    """Poll `scontrol show job` until `condition(record)` holds; return that record."""
    deadline = time.monotonic() + timeout
    while True:
        (record,) = cluster.job_info(job_id)
        if condition(record):
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} never reached the expected state; last record: {record}")
        time.sleep(0.25)


def _hostnames(cluster, nodelist: str) -> list[str]:
    """A Slurm node list ("node[1,3]") as names, in Slurm's order."""
    return _run(cluster, "scontrol", "show", "hostnames", nodelist).split()


def test_three_idle_nodes_in_one_partition(slurm_cluster):
    assert slurm_cluster.nodes == ["node1", "node2", "node3"]
    idle = {node: "idle" for node in slurm_cluster.nodes}
    deadline = time.monotonic() + 10  # a job from an earlier test may still be completing
    while True:
        out = _run(slurm_cluster, "sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o", "%N %t")
        states = dict(line.split() for line in out.splitlines())
        if states == idle or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert states == idle


def test_srun_places_one_task_on_each_node(slurm_cluster):
    out = _run(slurm_cluster, "srun", "-N3", "-n3", "--ntasks-per-node=1",
               "bash", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME")
    assert sorted(line.split() for line in out.splitlines()) == [["0", "node1"], ["1", "node2"], ["2", "node3"]]


def test_two_node_batch_job_steps_see_node_ids(slurm_cluster, tmp_path):
    # Single quotes: the variables must expand in each task, not once in the batch shell on the first node.
    job = _sbatch(slurm_cluster, tmp_path, "srun bash -c 'echo $SLURM_NODEID $SLURMD_NODENAME $SLURM_NNODES'",
                  "-N2", "--ntasks-per-node=1")
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
    # Two of the three nodes, whichever Slurm picked: node ids follow the order of the job's node list.
    allocated = _hostnames(slurm_cluster, slurm_cluster.job_info(job)[0]["NodeList"])
    assert len(allocated) == 2 and set(allocated) <= set(slurm_cluster.nodes), allocated
    lines = (tmp_path / f"slurm-{job}.out").read_text().splitlines()
    assert sorted(line.split() for line in lines) == [[str(i), node, "2"] for i, node in enumerate(allocated)]


def test_a_two_node_job_that_loses_a_node_runs_again_on_the_other_two(slurm_cluster, tmp_path):
    # Why the cluster has three nodes. Drained as well as down: ReturnToService=2 would otherwise take the node
    # back at its slurmd's next registration, since that slurmd is still running.
    job = _sbatch(slurm_cluster, tmp_path, 'echo "run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"; sleep 300',
                  "-N2", "--ntasks-per-node=1", "--requeue", "--open-mode=append")
    running = _wait_record(slurm_cluster, job, lambda r: r["JobState"] == "RUNNING")
    first = _hostnames(slurm_cluster, running["NodeList"])
    lost = first[-1]
    try:
        for state in ("drain", "down"):
            _run(slurm_cluster, "scontrol", "update", f"nodename={lost}", f"state={state}", "reason=nxdt-test-lost")
        # Slurm kills the job for the node's failure and requeues it; it starts again after cred_expire (10 s).
        record = _wait_record(slurm_cluster, job, lambda r: r["JobState"] == "RUNNING" and r["Restarts"] == "1",
                              timeout=30)
        again = _hostnames(slurm_cluster, record["NodeList"])
        assert len(again) == 2 and lost not in again and set(again) <= set(slurm_cluster.nodes), (first, again)
        output = tmp_path / f"slurm-{job}.out"  # and its script runs again there
        deadline = time.monotonic() + 5
        while "run 1" not in output.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"run 1 on {record['NodeList']}" in output.read_text(), output.read_text()
    finally:
        _run(slurm_cluster, "scancel", job)
        _run(slurm_cluster, "scontrol", "update", f"nodename={lost}", "state=resume")
    assert slurm_cluster.wait_job(job, timeout=15) == "CANCELLED"


def test_failed_job_and_its_afterok_dependent(slurm_cluster, tmp_path):
    failed = _sbatch(slurm_cluster, tmp_path, "exit 3")
    marker = tmp_path / "dependent-ran"
    dependent = _sbatch(slurm_cluster, tmp_path, f"touch {marker}", f"--dependency=afterok:{failed}")

    assert slurm_cluster.wait_job(failed, timeout=30) == "FAILED"
    assert slurm_cluster.job_info(failed)[0]["ExitCode"] == "3:0"
    # Slurm 22.05 without DependencyParameters=kill_invalid_depend (the default, as on ParallelCluster) keeps
    # the dependent job PENDING for ever, marked DependencyNeverSatisfied; it never runs and never leaves the
    # queue by itself, so a launcher must look for this reason and cancel the rest of the chain.
    record = _wait_record(slurm_cluster, dependent, lambda r: r["Reason"] == "DependencyNeverSatisfied")
    assert record["JobState"] == "PENDING"
    assert record["Dependency"] == f"afterok:{failed}(failed)"
    assert not marker.exists()
    _run(slurm_cluster, "scancel", dependent)
    assert slurm_cluster.wait_job(dependent, timeout=15) == "CANCELLED"
    assert not marker.exists()


def test_scancel_stops_a_running_job(slurm_cluster, tmp_path):
    job = _sbatch(slurm_cluster, tmp_path, "sleep 300")
    _wait_record(slurm_cluster, job, lambda r: r["JobState"] == "RUNNING")
    started = time.monotonic()
    _run(slurm_cluster, "scancel", job)
    assert slurm_cluster.wait_job(job, timeout=15) == "CANCELLED"
    assert time.monotonic() - started < 10


def test_requeued_job_runs_again_with_restart_count(slurm_cluster, tmp_path):
    # What preemption with PreemptMode=REQUEUE does to a job, triggered by hand.
    job = _sbatch(slurm_cluster, tmp_path, 'echo "run ${SLURM_RESTART_COUNT:-0}"; sleep 300',
                  "--requeue", "--open-mode=append")
    _wait_record(slurm_cluster, job, lambda r: r["JobState"] == "RUNNING")
    # RUNNING is Slurm's state, not the script's: on a busy machine it has not echoed yet. Requeued before it does,
    # the first run leaves no line (seen once in a loaded .ci/run).
    output = tmp_path / f"slurm-{job}.out"
    deadline = time.monotonic() + 30
    while not (output.exists() and "run 0" in output.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    _run(slurm_cluster, "scontrol", "requeue", job)
    # A requeued job may start again only after AuthInfo=cred_expire (10 s here, 120 s by default).
    _wait_record(slurm_cluster, job, lambda r: r["JobState"] == "RUNNING" and r["Restarts"] == "1", timeout=30)
    deadline = time.monotonic() + 5
    while "run 1" not in output.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    _run(slurm_cluster, "scancel", job)
    assert slurm_cluster.wait_job(job, timeout=15) == "CANCELLED"
    assert [line for line in output.read_text().splitlines() if line.startswith("run")] == ["run 0", "run 1"]
