# The preemption test on the real 2-node Slurm: a training job whose time limit (1 minute) is far shorter than its
# training gets SIGUSR1 from Slurm before the limit, saves, requeues itself, and finishes over several
# allocations with exactly the per-step losses of an uninterrupted run of the same config (fp32, CPU, dp=2 over
# two nodes; the local executor runs the reference with the same two workers). A job that depends on it with
# afterok waits through the requeues and runs once it completes.
#
# When the signal comes: slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT) and sends --signal's
# warning at the first check that finds the job within sig_time + 30 s of its end (sbatch(1): "may be sent up
# to 60 seconds earlier"). With a 60 s limit and sig_time 20 that is 10-40 s after the job starts, and it
# leaves at least one more 30 s check before the kill at the limit: time for the step, the save and the requeue.
# The training must take longer than 40 s even on a fast idle machine, so that the first allocation can never
# finish it. With sig_time 10 (a 20-50 s window) one CI run finished all 200 steps before the warning came
# and the requeued run had nothing left to resume. Most of the training's time is validation, which only
# the Slurm run does: it costs wall time without changing a training loss (the losses match the reference,
# which skips it), so the reference trains the same 200 steps in a third of the time (600 steps without
# validation made the test a minute longer). A warning that comes before the workers installed their handler
# (they start training 5-15 s in) kills them instead: that allocation is requeued without a checkpoint, and
# the next one is signalled mid-training in the same way.
#
#   python -m pytest -q tests/checkpoint/test_preemption_slurm.py      # 2-3 minutes
import json
import subprocess
import time
from pathlib import Path

import pytest

from launcher.slurm import dependency_flag
from runtime.checkpoint import committed_checkpoints, open_storage
from tests.checkpoint.launch_helpers import counting_corpus, losses, training_overrides
from tests.launcher.helpers import nxdt

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# 20-30 s of training at 7-10 steps/s on two CPU workers, and in the Slurm run 40 validations of 50 batches
# (30-40 s more): more than the 10-40 s before the warning. Measured on an idle 2-core machine: the warning came
# 35-37 s into the first allocation, after 118-135 of the 200 steps; all 200 need about 55 s.
STEPS, HIDDEN = 200, 384
VALIDATION = ("training.trainer.val_check_interval=5", "training.trainer.limit_val_batches=50")
SIGNAL_S = 20
# Enough allocations for a busy machine; an idle one needs two or three. On 2026-11-27 this machine, with the XLA
# tests beside, ran the first allocation to step 57 and each later one ~15 steps further (each pays the start and
# the resume before the next warning): 12 allocations. The budget and the deadline below allow for that.
MAX_RESTARTS = 16
DEADLINE_S = 80 * (MAX_RESTARTS + 1)  # an allocation: up to 60 s, plus the requeue
# Both runs: one worker on each of two nodes, one thread each (the thread count changes fp32 sums).
LAYOUT = ("training.trainer.num_nodes=2", "training.trainer.devices=1", "env_vars.OMP_NUM_THREADS=1",
          "training.exp_manager.create_tensorboard_logger=false")


def _overrides(data: Path, results: Path) -> list[str]:
    # A checkpoint only at the end: every other committed checkpoint is one a signal asked for.
    return training_overrides(data, results, steps=STEPS, every=STEPS, hidden=HIDDEN, extra=LAYOUT)


def _scontrol_job(env: dict, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


@pytest.mark.long("real Slurm time limits: the warning comes 10-40 s into each allocation and the job needs 2-3 of them")
def test_time_limit_signal_checkpoints_requeues_and_resumes_exactly(slurm_cluster, tmp_path):
    started = time.monotonic()
    data = counting_corpus(tmp_path / "data")
    reference = nxdt("cluster_type=local", *_overrides(data, tmp_path / "reference"), cwd=tmp_path, timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    results = tmp_path / "requeued"
    launched = nxdt(
        "cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", *_overrides(data, results), *VALIDATION,
        "training.run.time_limit=0:01:00", f"training.run.preemption_signal_s={SIGNAL_S}",
        f"training.run.max_restarts={MAX_RESTARTS}", cwd=tmp_path, env=slurm_cluster.env,
    )
    assert launched.returncode == 0, launched.stdout + launched.stderr
    job = str(json.loads((results / "gpt3_tiny" / "launch.json").read_text())["stages"][0]["job_id"])
    # What the launcher submits for the next stage: afterok, cancelled if the dependency can never be met.
    dependent = subprocess.run(
        ["sbatch", "--parsable", *dependency_flag("afterok", job), f"--partition={slurm_cluster.partition}",
         "--output=/dev/null", "--wrap", "true"],
        env=slurm_cluster.env, cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip().split(";")[0]

    # Follow both jobs until training is over: the dependent must wait through every requeue.
    seen, deadline = [], time.monotonic() + DEADLINE_S
    while True:
        training, waiting = _scontrol_job(slurm_cluster.env, job), _scontrol_job(slurm_cluster.env, dependent)
        seen.append((training.get("JobState"), int(training.get("Restarts", 0)), waiting.get("JobState")))
        if training.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}:
            break
        assert time.monotonic() < deadline, f"training job {job} still {training.get('JobState')}: {seen[-5:]}"
        time.sleep(0.5)
    logs_dir = results / "gpt3_tiny" / "training" / "logs"
    out = (logs_dir / f"training_{job}.out").read_text()
    assert seen[-1][0] == "COMPLETED", out[-4000:]
    assert slurm_cluster.wait_job(dependent, timeout=60) == "COMPLETED"
    assert all(after == "PENDING" for state, _, after in seen if state != "COMPLETED"), seen

    # At least two allocations, each but the last ended by a signal and a requeue from the script.
    restarts = seen[-1][1]
    assert restarts >= 1, out
    assert out.count("SIGUSR1") >= restarts and out.count(f"scontrol requeue {job}") == restarts, out
    node_logs = [[logs_dir / f"training_{job}_0_restart{r}_node{n}.log" for n in (0, 1)] for r in range(restarts + 1)]
    assert all(log.exists() for pair in node_logs for log in pair), sorted(p.name for p in logs_dir.iterdir())
    assert "resumed from" not in node_logs[0][0].read_text() and "resumed from" in node_logs[-1][0].read_text()
    assert (logs_dir / f"training_{job}_0.exit").read_text().strip() == "0"  # the last allocation's code
    status = nxdt("status", "gpt3_tiny", "--results-dir", str(results), env=slurm_cluster.env)
    assert "COMPLETED" in status.stdout, status.stdout

    storage = open_storage(results / "gpt3_tiny" / "training" / "checkpoints")
    checkpoints = [c.step for c in committed_checkpoints(storage)]
    assert checkpoints[-1] == STEPS and len(checkpoints) >= 2, checkpoints  # a signal's, and the last
    expected = losses(tmp_path / "reference" / "gpt3_tiny" / "training")
    got = losses(results / "gpt3_tiny" / "training")
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]
    print(f"\n{restarts + 1} allocations, checkpoints at {checkpoints}, {time.monotonic() - started:.0f} s")
