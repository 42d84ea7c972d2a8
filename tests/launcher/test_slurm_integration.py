"""The launcher against a real 3-node Slurm (tests/slurm_cluster.py): pipelines run in order across two
nodes, a failed stage stops the ones after it, and status, logs and cancel work without accounting.

The stage programs are replaced by a STAND-IN interpreter (`python=` override) that records where and
when it ran, so these tests time the launcher and Slurm rather than tokenization or training; the real
programs run on this cluster in tests/test_pipeline.py."""

import json
import time
from pathlib import Path

import pytest

from .helpers import nxdt

pytestmark = pytest.mark.slurm

STAND_IN = """#!/bin/bash
# Stand-in for the interpreter: records the stage, node and arguments, then behaves as configured.
echo "$NXDT_STAGE $SLURMD_NODENAME $SLURM_NODEID $(date +%s.%N) $*" >> "$RECORD"
echo "hello from $NXDT_STAGE on $SLURMD_NODENAME"
sleep "${STAGE_SLEEP:-0}"
if [ "$NXDT_STAGE" = "${FAIL_STAGE:-}" ]; then echo "failing on purpose" >&2; exit 3; fi
"""


@pytest.fixture
def launch(slurm_cluster, tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    record = tmp_path / "record.txt"
    results = tmp_path / "results"

    def run(*overrides: str, command: tuple[str, ...] = ()):
        args = list(command) or [
            "stages=[data_preparation,training]", "cluster_type=slurm", f"base_results_dir={results}",
            f"data_dir={tmp_path}/data", f"python={python}", f"env_vars.RECORD={record}",
            f"cluster.partition={slurm_cluster.partition}", "training.trainer.num_nodes=2",
            "training.trainer.devices=2", *overrides,
        ]
        return nxdt(*args, cwd=tmp_path, env=slurm_cluster.env)

    run.record, run.results = record, results
    return run


def _launch_record(results: Path, run_name: str = "gpt3_tiny") -> dict:
    return json.loads((results / run_name / "launch.json").read_text())


def _wait_all(slurm_cluster, record: dict, timeout: float = 120) -> list[str]:
    return [slurm_cluster.wait_job(str(s["job_id"]), timeout) for s in record["stages"]]


def _rows(record_file: Path) -> list[list[str]]:
    return [line.split() for line in record_file.read_text().splitlines()] if record_file.exists() else []


def test_pipeline_runs_in_order_across_two_nodes(slurm_cluster, launch):
    result = launch()
    assert result.returncode == 0, result.stdout + result.stderr
    record = _launch_record(launch.results)
    assert [s["stage"] for s in record["stages"]] == ["data_preparation", "training"]
    assert _wait_all(slurm_cluster, record) == ["COMPLETED", "COMPLETED"]

    rows = _rows(launch.record)
    prep = [r for r in rows if r[0] == "data_preparation"]
    train = [r for r in rows if r[0] == "training"]
    assert prep and len(train) == 2
    train_nodes = {r[1] for r in train}  # any two of the cluster's three
    assert len(train_nodes) == 2 and train_nodes <= set(slurm_cluster.nodes), "training must span two nodes"
    assert {r[2] for r in train} == {"0", "1"}
    assert max(float(r[3]) for r in prep) < min(float(r[3]) for r in train), "training ran before data prep"
    assert all("--node_rank" in r and "runtime.train" in r for r in train)

    status = nxdt("status", "gpt3_tiny", "--results-dir", str(launch.results), env=slurm_cluster.env)
    assert status.returncode == 0 and status.stdout.count("COMPLETED") == 2, status.stdout
    logs = nxdt("logs", "gpt3_tiny", "training", "--results-dir", str(launch.results), env=slurm_cluster.env)
    assert logs.returncode == 0, logs.stderr
    assert all(f"hello from training on {node}" in logs.stdout for node in train_nodes), logs.stdout


def test_failed_first_stage_never_runs_the_second(slurm_cluster, launch):
    result = launch("env_vars.FAIL_STAGE=data_preparation")
    assert result.returncode == 0, result.stdout + result.stderr
    record = _launch_record(launch.results)
    states = _wait_all(slurm_cluster, record)
    assert states[0] == "FAILED"
    assert states[1] == "CANCELLED"
    assert not [r for r in _rows(launch.record) if r[0] == "training"], "training ran after a failed stage"

    status = nxdt("status", "gpt3_tiny", "--results-dir", str(launch.results), env=slurm_cluster.env)
    assert status.returncode == 0
    assert "DependencyNeverSatisfied" in status.stdout, status.stdout
    logs = nxdt("logs", "gpt3_tiny", "data_preparation", "--results-dir", str(launch.results), env=slurm_cluster.env)
    assert "failing on purpose" in logs.stdout


def test_cancel_stops_every_stage(slurm_cluster, launch):
    result = launch("env_vars.STAGE_SLEEP=120")
    assert result.returncode == 0, result.stdout + result.stderr
    record = _launch_record(launch.results)
    first = str(record["stages"][0]["job_id"])
    deadline = time.monotonic() + 60
    while "RUNNING" not in nxdt("status", "gpt3_tiny", "--results-dir", str(launch.results),
                                env=slurm_cluster.env).stdout:
        assert time.monotonic() < deadline, "the first stage never started"
        time.sleep(1)
    # While Slurm runs one stage and queues the next, the run is live (launcher/live.py): launching it again is
    # refused, and a dry run of it renders elsewhere; neither touches a file of the run.
    scripts = {p: p.read_bytes() for p in launch.results.rglob("*.sbatch")}
    again = launch("env_vars.STAGE_SLEEP=120")
    assert again.returncode == 2, again.stdout + again.stderr
    assert "error: run_name: run gpt3_tiny is live (Slurm still has data_preparation (Slurm job " in again.stderr
    dry = launch("env_vars.STAGE_SLEEP=1", "--dry-run")
    assert dry.returncode == 0 and "this dry run wrote its files under" in dry.stdout, dry.stdout + dry.stderr
    assert _launch_record(launch.results) == record and scripts
    assert scripts == {p: p.read_bytes() for p in launch.results.rglob("*.sbatch")}
    cancel = nxdt("cancel", "gpt3_tiny", "--results-dir", str(launch.results), env=slurm_cluster.env)
    assert cancel.returncode == 0, cancel.stderr
    assert first in cancel.stdout
    assert _wait_all(slurm_cluster, record, timeout=60) == ["CANCELLED", "CANCELLED"]
    assert not [r for r in _rows(launch.record) if r[0] == "training"]


def test_a_refused_submission_leaves_nothing_queued(slurm_cluster, launch):
    result = launch("cluster.partition=no_such_partition")
    assert result.returncode == 2
    assert result.stderr.startswith("error: sbatch data_preparation.sbatch:"), result.stderr
    assert "Traceback" not in result.stderr
    assert not (launch.results / "gpt3_tiny" / "launch.json").exists()
