"""What the job script decides after a failed attempt (runtime/fault_tolerance/attempts.py), from attempt
directories as the nodes' runtime.torchrun write them, and the settings and fault specs refused before anything is
submitted. The decisions' effects on a real allocation are tests/checkpoint/test_fault_tolerance_slurm.py's."""
import json
from types import SimpleNamespace

import pytest

from runtime.fault_tolerance import attempts
from runtime.fault_tolerance.recovery import read_history
from runtime.schema import faults
from tests.launcher.helpers import nxdt


def _node(directory, node, outcome, **fields):
    (directory / f"node_{node}.json").write_text(json.dumps({"node": node, "outcome": outcome, "ended_at": 100.0,
                                                             "records": fields.pop("records", []), **fields}))


def _args(tmp_path, attempt_dir, attempt=0, exit=1, **kw):
    return SimpleNamespace(attempt_dir=str(attempt_dir), history=str(tmp_path / "history.jsonl"), stage="training",
                           job="7_0", attempt=attempt, exit=exit, in_job_restarts=kw.get("restarts", 3),
                           same_node_failures=kw.get("same", 2), requeues_on_failure=2, min_nodes=2,
                           allocation="node1 node2", excluded=kw.get("excluded", ""),
                           usable=kw.get("usable", "node1 node2 node3"), nodes_now=0, elastic=False)


@pytest.fixture
def nodes(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")


def _attempt(tmp_path, n):
    directory = tmp_path / f"attempt{n}"
    directory.mkdir()
    return directory


def test_a_worker_exit_restarts_until_the_same_node_fails_twice(tmp_path, nodes, capsys):
    first = _attempt(tmp_path, 0)
    _node(first, "node1", "signalled", signal=15)
    _node(first, "node2", "exit", rank=1, exit_code=1, failed_at=90.0,
          records=[{"rank": 1, "section": "step", "step": 10}])
    assert attempts.failed(_args(tmp_path, first)) == "restart"
    assert "attempt 0 failed: exit 1 of rank 1 on node2 at step 10; restarting" in capsys.readouterr().err
    second = _attempt(tmp_path, 1)
    _node(second, "node1", "signalled", signal=15)
    _node(second, "node2", "exit", rank=1, exit_code=1, failed_at=95.0)
    assert attempts.failed(_args(tmp_path, second, attempt=1)) == "check-nodes"
    history = read_history(str(tmp_path / "history.jsonl"))
    assert [(r["cause"], r["node"], r["action"], r["time_to_detect_s"]) for r in history] == \
        [("exit", "node2", "restart", 10.0), ("exit", "node2", "check nodes", 5.0)]


def test_a_hang_a_failed_preflight_a_silent_node_and_a_config_mistake(tmp_path, nodes):
    hang = _attempt(tmp_path, 0)
    (hang / "hang.json").write_text(json.dumps({"cause": "hang", "rank": 1, "node": "node2", "section": "checkpoint",
                                                "step": 12, "last_progress_at": 50.0, "detected_at": 62.0}))
    assert attempts.failed(_args(tmp_path, hang, exit=124)) == "restart"
    preflight = _attempt(tmp_path, 1)
    _node(preflight, "node1", "exit", rank=1, exit_code=attempts.PREFLIGHT_EXIT_CODE, failed_at=1.0)
    _node(preflight, "node2", "signalled")
    assert attempts.failed(_args(tmp_path, preflight, attempt=1)) == "check-nodes"
    silent = _attempt(tmp_path, 2)
    _node(silent, "node1", "signalled")
    assert attempts.failed(_args(tmp_path, silent, attempt=2)) == "check-nodes"
    mistake = _attempt(tmp_path, 3)
    _node(mistake, "node1", "exit", rank=0, exit_code=attempts.USER_ERROR_EXIT_CODE, failed_at=1.0)
    _node(mistake, "node2", "exit", rank=1, exit_code=attempts.USER_ERROR_EXIT_CODE, failed_at=1.0)
    assert attempts.failed(_args(tmp_path, mistake, attempt=0)) == "stop"
    causes = [(r["cause"], r.get("node")) for r in read_history(str(tmp_path / "history.jsonl"))]
    assert causes == [("hang", "node2"), ("preflight", "node1"), ("lost node", "node2"), ("exit", "node1")]
    used_up = _attempt(tmp_path, 4)
    _node(used_up, "node1", "exit", rank=0, exit_code=1, failed_at=1.0)
    _node(used_up, "node2", "signalled")
    assert attempts.failed(_args(tmp_path, used_up, attempt=3, same=9)) == "stop"


def test_node_checks_exclude_the_bad_node_or_say_too_few_are_left(tmp_path, nodes):
    checked = _attempt(tmp_path, 0)
    (checked / "check_node1.json").write_text(json.dumps({"node": "node1", "ok": True, "checks": []}))
    (checked / "check_node2.json").write_text(json.dumps({"node": "node2", "ok": False, "checks": [
        {"name": "memory", "status": "fail", "detail": "0.2 GiB available"}]}))
    assert attempts.checked(_args(tmp_path, checked)) == "requeue node2"
    assert attempts.checked(_args(tmp_path, checked, usable="node1 node2")) == "stop"
    history = read_history(str(tmp_path / "history.jsonl"))
    assert [r["action"] for r in history] == ["requeue", "stop"]
    assert history[0]["bad_nodes"] == {"node2": "memory: 0.2 GiB available"} and history[0]["exclude"] == ["node2"]
    (checked / "check_node2.json").unlink()  # a node that could not even report is bad
    # The job's own exclusions stay excluded.
    assert attempts.checked(_args(tmp_path, checked, excluded="node4", usable="node1 node2 node3 node4 node5")) == \
        "requeue node2,node4"
    # Two requeues already: fault_tolerance.requeues_on_failure is used up.
    assert attempts.checked(_args(tmp_path, checked, usable="node1 node2 node3 node4 node5")) == "stop"


@pytest.mark.parametrize("value, problem", [
    ("exit:rank=1:step=12", None), ("hang:rank=0:step=1:section=checkpoint", None),
    ("sleep:rank=0:step=1:seconds=20", None), ("unhealthy:node=node2", None), ("", None),
    ("crash:rank=1:step=2", "unknown fault 'crash'"), ("exit:rank=1", "a exit fault takes rank, step"),
    ("hang:rank=1:step=0", "step >= 1"), ("hang:rank=1:step=2:section=save", "section 'save'"),
    ("unhealthy:rank=1", "a unhealthy fault takes node"),
])
def test_fault_specs(value, problem):
    fault, found = faults.parse(value)
    if problem is None:
        assert found is None and (fault is None) == (value == "") and (not value or str(fault) == value)
    else:
        assert fault is None and problem in found and found.startswith(f"{faults.ENV}={value!r}: "), found


@pytest.mark.parametrize("override, message", [
    ("training.fault_tolerance.setup_timeout_s=0", "training.fault_tolerance.setup_timeout_s: 0 must be > 0"),
    ("training.fault_tolerance.step_timeout_s=-5", "training.fault_tolerance.step_timeout_s: -5 must be > 0"),
    ("training.fault_tolerance.in_job_restarts=-1",
     "training.fault_tolerance.in_job_restarts: -1 must be an integer >= 0"),
    ("training.fault_tolerance.requeues_on_failure=-2", "requeues_on_failure: -2 must be an integer >= 0"),
    ("+training.fault_tolerance.timeout=5", "training.fault_tolerance.timeout: unknown key"),
    ("cluster.exclude=[node1,node2]", "cluster.exclude: leaves 0 of the 2 nodes of cluster.nodelist (none) for a job "
                                      "of 1 node(s); exclude fewer nodes"),
    ("+env_vars.NXDT_INJECT_FAULT='hang:rank=1'", "NXDT_INJECT_FAULT='hang:rank=1': a hang fault takes rank, step"),
])
def test_bad_settings_are_refused_at_launch_in_one_line(tmp_path, override, message):
    result = nxdt("cluster_type=slurm", "stages=[training]", f"base_results_dir={tmp_path}/results",
                  "cluster.nodelist=[node1,node2]", override, "--dry-run", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "results").exists()


def test_hyperpod_runs_the_training_step_with_auto_resume(tmp_path):
    """SageMaker HyperPod's Slurm (cluster.hyperpod): its agents replace a faulty node and run the step again when
    the step is `srun --auto-resume=1`; the node checks and the rest stay ours. (No HyperPod here: the render.)"""
    result = nxdt("cluster_type=slurm", "stages=[training]", f"base_results_dir={tmp_path}/results",
                  "cluster.hyperpod=true", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    script = (tmp_path / "results" / "gpt3_tiny" / "training" / "training.sbatch").read_text()
    assert script.count("--auto-resume=1") == 1
    assert "  --auto-resume=1 \\\n" in script.split("bash -c node_main")[0].rsplit("srun --nodes=1", 1)[1]
    refused = nxdt("cluster_type=slurm", "stages=[training]", "cluster.hyperpod=maybe", "--dry-run", cwd=tmp_path)
    assert refused.returncode == 2 and "cluster.hyperpod: 'maybe' must be true" in refused.stderr
