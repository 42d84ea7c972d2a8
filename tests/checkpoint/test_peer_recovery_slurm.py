# Recovery from peers' memory on the real 3-node Slurm (docs/fault_tolerance.md): a 2-node training job of gpt3/tiny
# (dp=2 over two nodes, fp32) refreshes a copy of every worker's state in the peer stores after each step
# (fault_tolerance.peer_state_every_n_steps=1) and loses node2 as step 12's save begins (NXDT_INJECT_FAULT
# lost:node=node2:step=12: node2's workers, their torchrun and its peer store killed with SIGKILL; its health checks
# fail from then on). Its checkpoints on disk are every 10 steps, so the newest on disk is step 10's.
#   - with a spare (fault_tolerance.spare_nodes=1: three nodes allocated): node3 takes node2's place in the same
#     allocation, the workers resume from step 11's copies in the peers' memory (no checkpoint file: the disk's
#     newest is step 10), only step 12 is trained again, and every loss equals the uninterrupted run's, bitwise;
#   - without one (run.elastic=true): the job goes on on node1 alone, dp=1 with the same global batch, from the same
#     peer copies; its losses stay within 1e-6 of the uninterrupted dp=2 run's (tests/runtime_train/test_elastic.py
#     proves them bitwise equal to a dp=1 run resumed from the same state).
# The reference is the local executor's rendering of the same config without the recovery keys, its two workers
# forked from the test. Both jobs run at once (each takes one CPU of each of its nodes).
#
#   python -m pytest -q tests/checkpoint/test_peer_recovery_slurm.py      # ~1.5 minutes
import json
import time
from pathlib import Path

import pytest

from tests.checkpoint.launch_helpers import counting_corpus, train_rendered, training_overrides
from tests.launcher.helpers import nxdt

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY, FAULT_STEP = 16, 10, 12
LAYOUT = ("training.trainer.num_nodes=2", "training.trainer.devices=1", "env_vars.OMP_NUM_THREADS=1",
          "training.fault_tolerance.step_timeout_floor_s=30", "training.fault_tolerance.setup_timeout_s=120",
          "training.fault_tolerance.checkpoint_timeout_s=60")
PEER = ("training.fault_tolerance.peer_state_every_n_steps=1",)
JOBS = {"spare": PEER + ("training.fault_tolerance.spare_nodes=1",), "elastic": PEER + ("training.run.elastic=true",)}


def _records(training_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (training_dir / "metrics.jsonl").read_text().splitlines()]


def _history(training_dir: Path) -> list[dict]:
    path = training_dir / "logs" / "training_attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.long("two 2-node training jobs at once, each losing node2 at step 12 and recovering from the peers' "
                  "memory: onto a spare node, and on one node fewer")
def test_a_lost_node_recovers_from_the_peers_memory(slurm_cluster, tmp_path):
    started = time.monotonic()
    data = counting_corpus(tmp_path / "data")
    common = [o for o in training_overrides(data, tmp_path / "unused", steps=STEPS, every=EVERY, extra=LAYOUT)
              if not o.startswith("base_results_dir=")]
    reference = nxdt("cluster_type=local", f"base_results_dir={tmp_path / 'reference'}", *common, "--dry-run",
                     cwd=tmp_path, timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    assert train_rendered(tmp_path / "reference" / "gpt3_tiny" / "training" / "training_config.yaml") == [0, 0]
    expected = {r["step"]: r["loss"] for r in _records(tmp_path / "reference" / "gpt3_tiny" / "training")
                if "loss" in r}
    assert sorted(expected) == list(range(1, STEPS + 1))

    jobs = {}
    for name, keys in JOBS.items():
        results = tmp_path / name
        launched = nxdt("cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}",
                        f"base_results_dir={results}", *common, *keys, cwd=tmp_path,
                        env={**slurm_cluster.env, "NXDT_INJECT_FAULT": f"lost:node=node2:step={FAULT_STEP}"})
        assert launched.returncode == 0, launched.stdout + launched.stderr
        assert "peer" in launched.stdout + launched.stderr, launched.stdout  # the launch states K and its memory
        jobs[name] = str(json.loads((results / "gpt3_tiny" / "launch.json").read_text())["stages"][0]["job_id"])
    states = {name: slurm_cluster.wait_job(job, timeout=420) for name, job in jobs.items()}

    outcome = {}
    for name, job in jobs.items():
        training = tmp_path / name / "gpt3_tiny" / "training"
        out = (training / "logs" / f"training_{job}.out").read_text()
        assert states[name] == "COMPLETED", f"{name}: {states[name]}\n{out[-4000:]}"
        history = _history(training)
        failed = [r for r in history if r["event"] == "failed"]
        checks = [r for r in history if r["event"] == "node_check"]
        recovered = [r for r in history if r["event"] == "recovered"]
        assert len(failed) == 1 and len(checks) == 1 and len(recovered) == 1, (name, history, out[-3000:])
        # Every node's torchrun ended without a word (node1's killed by srun as node2 vanished): a lost node, and
        # the node checks name which.
        assert failed[0]["cause"] == "lost node" and list(checks[0]["bad_nodes"]) == ["node2"], (failed, checks)
        # From the peers' memory, at the step before the fault: newer than any checkpoint on disk (step 10), so no
        # checkpoint file can have been read; and only the step the node was lost in is trained again.
        r = recovered[0]
        assert (r["state_from"], r["resumed_from_step"], r["steps_redone"], r["disk_reads"]) == (
            "peer", FAULT_STEP - 1, 1, 0) and r["fault_step"] >= FAULT_STEP, r
        assert "no file read" in "".join(p.read_text() for p in (training / "logs").glob("*attempt1*node*.log"))
        got = [(x["step"], x["loss"]) for x in _records(training) if "loss" in x]
        assert sorted({s for s, _ in got}) == list(range(1, STEPS + 1)), (name, got)
        status = nxdt("status", "gpt3_tiny", "--results-dir", str(tmp_path / name), env=slurm_cluster.env)
        assert "COMPLETED" in status.stdout and "from the peers' memory" in status.stdout, status.stdout
        outcome[name] = (checks[0], got, r, out)
        print(f"\n{name}: lost node2 at step {FAULT_STEP}; {checks[0]['action']}; resumed from step "
              f"{r['resumed_from_step']} in the memory of {r['state_where']} ({r['state_load_s']} s), "
              f"{r['time_to_recover_s']} s to recover, {r['time_lost_s']} s lost")

    # A spare: node3 takes node2's place in the same allocation; every loss is the uninterrupted run's, bitwise.
    check, got, r, out = outcome["spare"]
    assert check["action"] == "replace", check
    assert all(loss == expected[step] for step, loss in got), got
    assert "without node2" in out, out[-3000:]

    # No spare: the job goes on on node1 alone, dp 1, the same global batch; within 1e-6 of the dp 2 run.
    check, got, r, out = outcome["elastic"]
    assert check["action"] == "shrink", check
    assert all(loss == expected[step] for step, loss in got if step <= FAULT_STEP - 1), got
    assert all(abs(loss - expected[step]) <= 1e-6 * abs(expected[step]) for step, loss in got), got
    logs = "".join(p.read_text() for p in (tmp_path / "elastic" / "gpt3_tiny" / "training" / "logs").glob(
        "*attempt1*node*.log"))
    assert "nxdt: elastic: training on 1 of 2 nodes, data parallel 1 (was 2)" in logs, logs[-3000:]
    print(f"{time.monotonic() - started:.0f} s")
