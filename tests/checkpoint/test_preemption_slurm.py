# The preemption test on the real 3-node Slurm: a training job submitted with a 1-minute time limit, far shorter
# than its training, gets Slurm's time-limit warning (SIGUSR1, training.run.preemption_signal_s) in a real
# allocation, commits a checkpoint, requeues itself, and a later allocation resumes it and finishes with exactly
# the per-step losses of an uninterrupted run of the same config (fp32, CPU, dp=2 over two nodes; the reference is
# the local executor's rendering of it, its two workers forked from the test). A job that depends on it with
# afterok waits through the requeues and runs once it completes.
#
# When the signal comes: slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT) and sends --signal's
# warning at the first check that finds the job within sig_time + 30 s of its end (sbatch(1): "may be sent up
# to 60 seconds earlier"). With a 60 s limit and sig_time 20 that is 10-40 s after the job starts, and it
# leaves at least one more 30 s check before the kill at the limit: time for the step, the save and the requeue.
# The training must take longer than 40 s even on a fast idle machine, so that the first allocation can never
# finish it. With sig_time 10 (a 20-50 s window) one CI run finished all 200 steps before the warning came
# and the requeued run had nothing left to resume. The Slurm run sleeps after each step (NXDT_STEP_PAUSE_S,
# runtime/train.py) rather than computing longer: it used to train a wider model with 40 validations, which kept
# two cores busy for minutes only to outlast the warning (and took longer the busier the machine was). A pause
# changes no loss; the reference, run without it, trains the same steps in seconds.
#
# Once one signal's checkpoint is committed and the job has requeued itself, the test raises the job's time
# limit (scontrol update TimeLimit, as root: what an operator does for a requeued job that needs longer), so
# that the next allocation resumes and trains to the end without another warning. What is under test is
# signal -> checkpoint -> requeue -> exact resume, and one round of it shows that; a 1-minute limit for every
# allocation only repeated it, and on a slow machine (each allocation pays the start and the resume before its
# warning, ~15 steps further) took up to 12 allocations and 7 minutes. With the limit raised, the test's
# length no longer depends on the machine's speed.
#
# A warning that comes before the workers installed their handler (they start training 5-40 s in, later on a
# loaded machine) kills them instead: that allocation is requeued without a checkpoint. Its successors would
# meet the same fate: the requeue follows the warning within a second and Slurm starts the requeued job again
# ~12 s later (below), so each new allocation starts ~12 s after one of slurmctld's checks and gets its warning
# at the next one, 18 s in (seen on a loaded machine: 13 allocations in a row, one every 30 s, none of them
# training). So then the test raises the limit for the next allocation and, once its workers are training,
# brings the job's end 45 s near (scontrol update EndTime): the same warning from the same time-limit check,
# at the next one.
#
# Slurm holds a requeued job until AuthInfo=cred_expire + 1 s have passed (10 + 1 on the test cluster,
# csp_tools/local_slurm; 121 s by default), so that its new launch credential postdates the revoked one and
# the old allocation's steps are gone; with the 2 s scheduling interval it restarts ~12 s after the requeue.
# `scontrol update StartTime=now` would skip that guard; the test keeps it, as a real cluster would.
#
# Length: the reference (seconds), the first allocation (up to its warning, 10-40 s), the requeue (~12 s) and
# the rest of the 100 paused steps in one more allocation: about 2 minutes, most of it sleeping, on an idle
# machine or a loaded one.
#
#   python -m pytest -q tests/checkpoint/test_preemption_slurm.py      # ~2 minutes
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from launcher.slurm import dependency_flag
from runtime.checkpoint import committed_checkpoints, open_storage
from tests.checkpoint.launch_helpers import counting_corpus, losses, train_rendered, training_overrides
from tests.launcher.helpers import nxdt

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# 100 steps with a 0.6 s pause after each: over a minute, more than the 10-40 s before the warning (it was 200
# steps of 0.3 s: the same length, twice the training, in the Slurm run and in its reference).
STEPS, PAUSE_S = 100, 0.6
SIGNAL_S = 20
# The limit once a signal's checkpoint is committed: the rest of the training, on a loaded machine too, well
# before this limit's own warning.
EXTENDED_MIN = 15
# A job end set this far away gets the warning (within sig_time + 30 s of the end) at slurmctld's next check,
# and the kill at least one 30 s check later.
ARMED_END_S = 45
# The run needs two allocations, three when the first warning comes before the workers are training; the
# rest is room.
MAX_RESTARTS = 6
# Four short allocations (up to 60 s each, plus the requeue), and the last one's training on a slow machine.
DEADLINE_S = 4 * 80 + 60 * EXTENDED_MIN
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}
# Both runs: one worker on each of two nodes, one thread each (the thread count changes fp32 sums).
LAYOUT = ("training.trainer.num_nodes=2", "training.trainer.devices=1", "env_vars.OMP_NUM_THREADS=1",
          "training.exp_manager.create_tensorboard_logger=false")


def _overrides(data: Path, results: Path) -> list[str]:
    # A checkpoint only at the end: every other committed checkpoint is one a signal asked for.
    return training_overrides(data, results, steps=STEPS, every=STEPS, extra=LAYOUT)


def _scontrol_job(env: dict, job_id: str) -> dict[str, str]:
    # scontrol can time out while slurmctld is busy (a loaded 2-core CI machine): ask again rather than record
    # a job without a state.
    for _ in range(5):
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True)
        fields = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)
        if shown.returncode == 0 and "JobState" in fields:
            return fields
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job_id} failed 5 times: {shown.stderr.strip()}")


def _scontrol_update(env: dict, job_id: str, setting: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", "update", f"JobId={job_id}", setting], env=env, capture_output=True,
                          text=True)


def _signal_checkpoints(storage) -> list[int]:
    """The committed checkpoints' steps before the end: the ones a signal asked for."""
    return [c.step for c in committed_checkpoints(storage) if c.step < STEPS]


def _training(node_log: Path) -> bool:
    """Whether this allocation's workers are in the step loop (its rank-0 log reports a step), and so have
    their signal handler: runtime/train.py installs it right before the loop."""
    try:
        text = node_log.read_text(errors="replace")
    except FileNotFoundError:
        return False
    return re.search(r"^step \d+/\d+ ", text, re.MULTILINE) is not None


@pytest.mark.long("real Slurm time limits: the warning comes 10-40 s into a 1-minute allocation, which must not "
                  "finish the training, then the requeued job (held 11 s) resumes in a second allocation")
def test_time_limit_signal_checkpoints_requeues_and_resumes_exactly(slurm_cluster, tmp_path):
    started = time.monotonic()
    data = counting_corpus(tmp_path / "data")
    # The reference as the local executor renders it (--dry-run), its two ranks forked from this process
    # (train_rendered): what is under test here is the Slurm job; a torchrun launch would only import torch again.
    reference = nxdt("cluster_type=local", *_overrides(data, tmp_path / "reference"), "--dry-run", cwd=tmp_path,
                     timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    assert train_rendered(tmp_path / "reference" / "gpt3_tiny" / "training" / "training_config.yaml") == [0, 0]

    results = tmp_path / "requeued"
    launched = nxdt(
        "cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", *_overrides(data, results),
        f"env_vars.NXDT_STEP_PAUSE_S={PAUSE_S}",
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
    logs_dir = results / "gpt3_tiny" / "training" / "logs"
    storage = open_storage(results / "gpt3_tiny" / "training" / "checkpoints")

    # Follow both jobs until training is over: the dependent must wait through every requeue. Once the job has
    # requeued itself after a signal's checkpoint, raise its limit for the rest of the training; while it has
    # requeued without one (the warning came before the workers were training), raise it for the next
    # allocation and bring that allocation's end near once its workers are training (see the top of the file).
    seen, deadline = [], time.monotonic() + DEADLINE_S
    extended_at, unready, armed = None, set(), set()
    while True:
        # The dependent first: a dependent seen running was started after the training's end, so the training's
        # state read next is COMPLETING (Slurm starts an afterok dependent once the exit code is in, before the
        # epilog is done) or COMPLETED. Read the other way round, a training seen RUNNING could end and start the
        # dependent between the two reads (one CI run saw that).
        waiting, training = _scontrol_job(slurm_cluster.env, dependent), _scontrol_job(slurm_cluster.env, job)
        state, restarts = training.get("JobState"), int(training.get("Restarts", 0))
        seen.append((state, restarts, waiting.get("JobState")))
        if state in FINAL:
            break
        assert time.monotonic() < deadline, f"training job {job} still {state}: {seen[-5:]}"
        if restarts and extended_at is None:
            signal_checkpoints = _signal_checkpoints(storage)
            if signal_checkpoints and state != "RUNNING":  # requeued after the signal's checkpoint
                update = _scontrol_update(slurm_cluster.env, job, f"TimeLimit={EXTENDED_MIN}")
                assert update.returncode == 0, update.stderr
                extended_at = restarts
            elif not signal_checkpoints and restarts not in unready:
                update = _scontrol_update(slurm_cluster.env, job, f"TimeLimit={EXTENDED_MIN}")
                assert update.returncode == 0, update.stderr
                unready.add(restarts)
            elif (not signal_checkpoints and state == "RUNNING" and restarts not in armed
                  and _training(logs_dir / f"training_{job}_0_restart{restarts}_node0.log")):
                # Fails only if the allocation ended meanwhile; then the next pass sees the requeue.
                if _scontrol_update(slurm_cluster.env, job, f"EndTime=now+{ARMED_END_S}").returncode == 0:
                    armed.add(restarts)
        time.sleep(0.5)
    out = (logs_dir / f"training_{job}.out").read_text()
    assert seen[-1][0] == "COMPLETED", out[-4000:]
    assert slurm_cluster.wait_job(dependent, timeout=60) == "COMPLETED"
    early = [entry for entry in seen if entry[2] != "PENDING" and entry[0] not in ("COMPLETING", "COMPLETED")]
    assert not early, f"the dependent left PENDING before the training completed: {early} (of {len(seen)} polls)"

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

    checkpoints = [c.step for c in committed_checkpoints(storage)]
    assert checkpoints[-1] == STEPS and len(checkpoints) >= 2, checkpoints  # a signal's, and the last
    expected = losses(tmp_path / "reference" / "gpt3_tiny" / "training")
    got = losses(results / "gpt3_tiny" / "training")
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]
    print(f"\n{restarts + 1} allocations (limit raised after restart {extended_at}; without a checkpoint: "
          f"{sorted(unready)}, armed: {sorted(armed)}), checkpoints at {checkpoints}, "
          f"{time.monotonic() - started:.0f} s")
