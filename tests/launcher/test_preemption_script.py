"""What the training job script does around its step when signalled: it passes USR1 on to the step, requeues the
job after it (or after exit 75) while restarts are left, never after TERM, and writes no exit file for an
allocation it requeued. The script runs under bash here with stand-ins for `srun`, `scontrol` and `sinfo` (FAKES,
named as such); tests/checkpoint/test_preemption_slurm.py runs the same script on the real 2-node Slurm."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.launch import build
from launcher.render import render

from .helpers import resolved

FAKE_SRUN = """#!/bin/bash
# FAKE srun: stands for the whole training step. FAKE_STEP=exit:N ends with N; FAKE_STEP=save waits for a
# signal: after USR1 it exits 1, as torchrun does once its workers saved and exited 75; after TERM, 143.
echo $$ > "$RECORD_DIR/step.pid"
case "$FAKE_STEP" in
  exit:*) exit "${FAKE_STEP#exit:}" ;;
  save)
    trap 'echo USR1 >> "$RECORD_DIR/step.signals"; exit 1' USR1
    trap 'echo TERM >> "$RECORD_DIR/step.signals"; exit 143' TERM
    for _ in $(seq 300); do sleep 0.1; done
    exit 0 ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
# FAKE scontrol: one node at 127.0.0.1; `requeue` is recorded and answers FAKE_REQUEUE_EXIT.
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=node1" ;;
  requeue*) echo "$2" >> "$RECORD_DIR/requeued"; exit "${FAKE_REQUEUE_EXIT:-0}" ;;
esac
"""
# FAKE sinfo: the partition's one node, idle (the real one, finding no controller, retries for a minute).
FAKE_SINFO = """#!/bin/bash
echo "node1 idle"
"""
JOB_ID = "4242"


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def job_script(tmp_path):
    """Runs the rendered training script; returns (exit code, exit file text or None, requeue calls, output)."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    _executable(bin_dir / "sinfo", FAKE_SINFO)
    results = tmp_path / "results"

    def run(step: str, *, restart: int = 0, send: signal.Signals | None = None, requeue_exit: int = 0,
            overrides: tuple[str, ...] = ("training.run.max_restarts=3",)):
        cfg = resolved(f"base_results_dir={results}", "data_dir=/data", "python=/bin/false", *overrides,
                       stable=False)
        job = next(j for j in build({**cfg, "stages": ["training"]}) if j.stage == "training")
        script = tmp_path / "training.sbatch"
        script.write_text(render(job, cfg, executor="slurm", produced_by="test"))
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_DIR": str(records),
               "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "node1", "SLURM_RESTART_COUNT": str(restart),
               "FAKE_STEP": step, "FAKE_REQUEUE_EXIT": str(requeue_exit)}
        for name in ("requeued", "step.pid", "step.signals"):
            (records / name).unlink(missing_ok=True)
        process = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        if send is not None:
            deadline = time.monotonic() + 20
            while not (records / "step.pid").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # the step's traps are set
            os.kill(process.pid, send)
            if send == signal.SIGTERM:  # Slurm sends TERM to every process of the job, the step's included
                os.kill(int((records / "step.pid").read_text()), signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        exit_file = results / "gpt3_tiny" / "training" / "logs" / f"training_{JOB_ID}_0.exit"
        requeued = (records / "requeued").read_text().split() if (records / "requeued").exists() else []
        code_written = exit_file.read_text().strip() if exit_file.exists() else None
        return process.returncode, code_written, requeued, output, records

    return run


def test_usr1_reaches_the_step_and_the_job_requeues_without_an_exit_file(job_script):
    code, exit_file, requeued, output, records = job_script("save", send=signal.SIGUSR1)
    assert (records / "step.signals").read_text().split() == ["USR1"], output
    assert requeued == [JOB_ID], output
    assert code == 0 and exit_file is None, output
    assert f"scontrol requeue {JOB_ID} (restart 1 of at most 3)" in output


def test_exit_75_without_a_signal_requeues_too(job_script):
    code, exit_file, requeued, output, _ = job_script("exit:75", restart=1)
    assert requeued == [JOB_ID] and code == 0 and exit_file is None, output
    assert "(restart 2 of at most 3)" in output


def test_no_requeue_once_max_restarts_is_reached(job_script):
    code, exit_file, requeued, output, _ = job_script("save", restart=3, send=signal.SIGUSR1)
    assert requeued == [] and code == 75 and exit_file == "75", output
    assert "training.run.max_restarts is 3: not requeueing" in output


def test_a_failed_requeue_stops_with_exit_75(job_script):
    code, exit_file, requeued, output, _ = job_script("save", send=signal.SIGUSR1, requeue_exit=1)
    assert requeued == [JOB_ID] and code == 75 and exit_file == "75", output
    assert f"scontrol requeue {JOB_ID} failed" in output


def test_term_is_not_passed_on_and_never_requeues(job_script):
    # scancel, the time limit, a preemption: Slurm ends the job, and decides whether it runs again.
    code, exit_file, requeued, output, records = job_script("save", send=signal.SIGTERM)
    assert (records / "step.signals").read_text().split() == ["TERM"], output  # from "Slurm", once
    assert requeued == [] and code == 143 and exit_file == "143", output


@pytest.mark.parametrize("step_exit", [0, 3])
def test_without_a_signal_the_step_code_is_the_job_code(job_script, step_exit):
    code, exit_file, requeued, output, _ = job_script(f"exit:{step_exit}")
    assert requeued == [] and code == step_exit and exit_file == str(step_exit), output


def test_without_the_keys_the_script_handles_no_signals(job_script):
    code, exit_file, requeued, output, _ = job_script(
        "exit:75", overrides=("training.run.preemption_signal_s=null", "training.run.max_restarts=0"))
    assert requeued == [] and code == 75 and exit_file == "75", output
