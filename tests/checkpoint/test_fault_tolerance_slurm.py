# Self-healing jobs on the real 3-node Slurm (docs/fault_tolerance.md): a 2-node training job of gpt3/tiny with a
# checkpoint every 4 steps meets one injected fault (NXDT_INJECT_FAULT, runtime/schema/faults.py, in the submitting
# environment, which sbatch passes on to every worker) and finishes by itself, with exactly the per-step losses of an
# uninterrupted run of the same config (fp32, dp=2 over two nodes; the reference is the local executor's rendering
# of it, its two workers forked from the test):
#   - a rank killed at step 10: the job restarts its workers on the same allocation, resuming from step 8 (or 4,
#     where step 8's asynchronous save had not committed when the rank died);
#   - a rank hung at step 10: the node's watchdog names rank, host and section once its step timeout (floor 10 s)
#     passes, and the job restarts as above;
#   - node2's health check failing: the preflight fails there, the job checks every node, names node2, requeues
#     itself excluding it and runs on node1 and node3.
# The three jobs run at once (each takes one CPU of each of its nodes; the cluster has four per node), so the test
# costs about as long as its slowest job, the bad node's requeue (Slurm holds a requeued job 11 s here).
#
#   python -m pytest -q tests/checkpoint/test_fault_tolerance_slurm.py      # ~2 minutes
import json
import re
import time
from pathlib import Path

import pytest

from tests.checkpoint.launch_helpers import counting_corpus, train_rendered, training_overrides
from tests.launcher.helpers import nxdt

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY, FAULT_STEP = 16, 4, 10
LAYOUT = ("training.trainer.num_nodes=2", "training.trainer.devices=1", "env_vars.OMP_NUM_THREADS=1",
          "training.trainer.preflight=true", "training.trainer.preflight_timeout_s=30")
# Short timeouts, so that a hang is found in seconds: a tiny step takes ~0.05 s, its learned timeout is the floor.
TIMEOUTS = ("training.fault_tolerance.step_timeout_floor_s=10", "training.fault_tolerance.setup_timeout_s=120",
            "training.fault_tolerance.checkpoint_timeout_s=60")
FAULTS = {"killed": "exit:rank=1:step=10", "hung": "hang:rank=1:step=10", "bad_node": "unhealthy:node=node2"}


def _losses_all(training_dir: Path) -> list[tuple[int, float]]:
    """Every (step, loss) record, in order: a restarted run logs the steps after its checkpoint again."""
    rows = [json.loads(line) for line in (training_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _history(training_dir: Path) -> list[dict]:
    path = training_dir / "logs" / "training_attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.long("three 2-node training jobs at once, each failing once and recovering by itself: a restart, a "
                  "hang's timeout and a requeue onto the third node")
def test_dead_rank_hung_rank_and_bad_node_recover_by_themselves(slurm_cluster, tmp_path):
    started = time.monotonic()
    data = counting_corpus(tmp_path / "data")
    common = training_overrides(data, tmp_path / "unused", steps=STEPS, every=EVERY, extra=LAYOUT + TIMEOUTS)
    common = [o for o in common if not o.startswith("base_results_dir=")]
    # The reference as the local executor renders it (--dry-run), its two ranks forked from this process
    # (train_rendered): what is under test here is the Slurm jobs; a torchrun launch would only import torch again.
    reference = nxdt("cluster_type=local", f"base_results_dir={tmp_path / 'reference'}", *common, "--dry-run",
                     cwd=tmp_path, timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    assert train_rendered(tmp_path / "reference" / "gpt3_tiny" / "training" / "training_config.yaml") == [0, 0]
    expected = dict(_losses_all(tmp_path / "reference" / "gpt3_tiny" / "training"))
    assert sorted(expected) == list(range(1, STEPS + 1))

    jobs = {}
    for name, fault in FAULTS.items():
        results = tmp_path / name
        launched = nxdt("cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}",
                        f"base_results_dir={results}", *common, cwd=tmp_path,
                        env={**slurm_cluster.env, "NXDT_INJECT_FAULT": fault})
        assert launched.returncode == 0, launched.stdout + launched.stderr
        jobs[name] = str(json.loads((results / "gpt3_tiny" / "launch.json").read_text())["stages"][0]["job_id"])
    states = {name: slurm_cluster.wait_job(job, timeout=420) for name, job in jobs.items()}

    for name, job in jobs.items():
        training = tmp_path / name / "gpt3_tiny" / "training"
        out = (training / "logs" / f"training_{job}.out").read_text()
        assert states[name] == "COMPLETED", f"{name}: {states[name]}\n{out[-4000:]}"
        # Bitwise: every loss logged, those of the steps trained twice included, is the uninterrupted run's.
        got = _losses_all(training)
        assert sorted({s for s, _ in got}) == list(range(1, STEPS + 1)), (name, got)
        assert all(loss == expected[step] for step, loss in got), (name, got, expected)
        history = _history(training)
        failed = [r for r in history if r["event"] == "failed"]
        recovered = [r for r in history if r["event"] == "recovered"]
        assert len(failed) == 1 and len(recovered) == 1, (name, history, out[-3000:])
        assert recovered[0]["time_to_recover_s"] > 0 and recovered[0]["time_lost_s"] > 0, recovered
        metrics_events = [json.loads(line) for line in (training / "metrics.jsonl").read_text().splitlines()
                          if '"event"' in line]
        assert [e["event"] for e in metrics_events] == ["recovered"], metrics_events
        status = nxdt("status", "gpt3_tiny", "--results-dir", str(tmp_path / name), env=slurm_cluster.env)
        assert "COMPLETED" in status.stdout and "training: attempt 0" in status.stdout, status.stdout
        print(f"\n{name}: {failed[0]['cause']} on {failed[0]['node']}, detected in "
              f"{failed[0].get('time_to_detect_s')} s; resumed from step {recovered[0]['resumed_from_step']}, "
              f"{recovered[0]['time_to_recover_s']} s to recover, {recovered[0]['time_lost_s']} s lost")
        jobs[name] = (job, training, out, failed[0], recovered[0], status.stdout)

    # A killed rank: the worker's own exit, restarted in the same allocation from the newest complete checkpoint:
    # step 8's, or step 4's where step 8's asynchronous save had not committed yet (a loaded machine).
    job, training, out, failed, recovered, status = jobs["killed"]
    assert (failed["cause"], failed["rank"], failed["step"], failed["action"]) == ("exit", 1, FAULT_STEP, "restart")
    assert recovered["resumed_from_step"] in (4, 8) and "attempt 1" in out, out[-3000:]
    assert "exit 1 of rank 1" in status and f"resumed from step {recovered['resumed_from_step']}" in status, status

    # A hung rank: named with its host and section by its node's watchdog, then restarted as above.
    job, training, out, failed, recovered, status = jobs["hung"]
    # The watchdog that decides first prints it, on either node.
    node_logs = "".join((training / "logs" / f"training_{job}_0_restart0_node{n}.log").read_text() for n in (0, 1))
    line = re.search(r"nxdt: hang: rank 1 on node2 made no progress in section step \(step 10\).*", node_logs)
    assert line and node_logs.count("nxdt: hang:") == 1, node_logs[-3000:]
    assert "other rank(s) wait for it in a collective" in line.group(0), line.group(0)
    assert (failed["cause"], failed["rank"], failed["node"], failed["section"]) == ("hang", 1, "node2", "step")
    assert 10 <= failed["time_to_detect_s"] < 60, failed  # its 10 s timeout, a poll, the stacks, the answers
    assert recovered["resumed_from_step"] in (4, 8) and "hang of rank 1 on node2 in step" in status, status

    # A bad node: named by the checks, excluded, and the job requeued onto the other two.
    job, training, out, failed, recovered, status = jobs["bad_node"]
    assert (failed["cause"], failed["node"], failed["action"]) == ("preflight", "node2", "check nodes"), failed
    checks = [r for r in _history(training) if r["event"] == "node_check"]
    assert len(checks) == 1 and list(checks[0]["bad_nodes"]) == ["node2"] and checks[0]["action"] == "requeue"
    assert "injected fault" in checks[0]["bad_nodes"]["node2"], checks
    info = slurm_cluster.job_info(job)[0]
    assert info["ExcNodeList"] == "node2" and info["NodeList"] == "node[1,3]", info
    assert recovered["resumed_from_step"] == 0 and "node checks after attempt 0: bad: node2" in status, status
    print(f"{time.monotonic() - started:.0f} s")


def test_excluding_every_node_of_the_partition_is_refused_at_launch(slurm_cluster, recipe_data_dir, tmp_path):
    """cluster.exclude against the partition as sinfo lists it at launch: a job that could never start is refused in
    one line, and nothing is submitted or written."""
    result = nxdt("cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", "stages=[training]",
                  f"base_results_dir={tmp_path}/results", f"data_dir={recipe_data_dir}", "training.trainer.num_nodes=2",
                  "cluster.exclude=[node1,node3]", cwd=tmp_path, env=slurm_cluster.env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (f"error: cluster.exclude: leaves 1 of the 3 nodes of partition {slurm_cluster.partition} (node2) for a "
            "job of 2 node(s); exclude fewer nodes") in result.stderr, result.stderr
    assert not (tmp_path / "results").exists()
