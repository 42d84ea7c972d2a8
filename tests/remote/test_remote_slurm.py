"""The whole pipeline submitted, watched and cancelled from "a laptop" over SSH: the launcher talks only to the
test sshd (tests/remote/conftest.py), whose sessions reach the local 3-node Slurm; this process's own
SLURM_CONF names no file (tests/conftest.py), so nothing can reach Slurm except through SSH. Remote paths are
this machine's paths (one machine plays both parts), and the laptop side runs from its own directory, so that
status/logs/cancel find the run through the local record of the remote launch.

The stage programs are the STAND-IN interpreter of tests/launcher/test_slurm_integration.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launcher.helpers import nxdt
from tests.launcher.test_slurm_integration import STAND_IN

pytestmark = pytest.mark.slurm


@pytest.fixture
def laptop(slurm_cluster, sshd, tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    home = tmp_path / "laptop"
    home.mkdir()
    env = {"NXDT_STATE_DIR": str(tmp_path / "state")}

    def run(*args: str, launch: bool = False, **kwargs):
        if launch:
            args = (*sshd.overrides(), "stages=[data_preparation,training]", f"base_results_dir={tmp_path}/results",
                    f"data_dir={tmp_path}/data", f"python={python}", f"env_vars.RECORD={tmp_path}/record.txt",
                    f"cluster.partition={slurm_cluster.partition}", "training.trainer.num_nodes=2",
                    "training.trainer.devices=2", *args)
        return nxdt(*args, cwd=home, env=env, **kwargs)

    run.tmp, run.env, run.home = tmp_path, env, home
    assert not os.path.exists(os.environ["SLURM_CONF"]), "this side must not reach Slurm but through SSH"
    return run


def _wait_for(laptop, word: str, count: int = 1, timeout: float = 120) -> str:
    """`status` from the laptop until `word` shows for `count` stages."""
    deadline = time.monotonic() + timeout
    while True:
        status = laptop("status", "gpt3_tiny")
        assert status.returncode == 0, status.stderr
        if status.stdout.count(word) >= count:
            return status.stdout
        assert time.monotonic() < deadline, status.stdout
        time.sleep(1)


def test_submit_watch_and_read_logs_over_ssh(laptop, sshd, slurm_cluster):
    before = sshd.connections()
    result = laptop(launch=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sshd.connections() - before == 1, "one launch, one SSH connection (SFTP and every sbatch share it)"
    here = json.loads((laptop.tmp / "state" / "runs" / "gpt3_tiny" / "launch.json").read_text())
    there = json.loads((laptop.tmp / "results" / "gpt3_tiny" / "launch.json").read_text())
    assert here["remote"]["host"] == "127.0.0.1" and "remote" not in there
    assert [s["job_id"] for s in here["stages"]] == [s["job_id"] for s in there["stages"]]

    before = sshd.connections()
    _wait_for(laptop, "COMPLETED", count=2)
    assert sshd.connections() > before, "status must ask Slurm over SSH"
    rows = (laptop.tmp / "record.txt").read_text().splitlines()
    train_nodes = {r.split()[1] for r in rows if r.startswith("training")}  # any two of the cluster's three
    assert len(train_nodes) == 2 and train_nodes <= set(slurm_cluster.nodes), rows

    logs = laptop("logs", "gpt3_tiny", "training")
    assert logs.returncode == 0, logs.stderr
    assert all(f"hello from training on {node}" in logs.stdout for node in train_nodes), logs.stdout

    # logs -f streams over SSH until interrupted.
    follow = subprocess.Popen([sys.executable, "-m", "launcher.cli", "logs", "gpt3_tiny", "training", "-f"],
                              cwd=laptop.home, env={**os.environ, **laptop.env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 30
        while not all(f"hello from training on {node}" in seen for node in train_nodes):
            assert time.monotonic() < deadline, seen
            seen += follow.stdout.readline()
        follow.send_signal(signal.SIGINT)
        assert follow.wait(timeout=15) in (0, 130, -signal.SIGINT)
    finally:
        if follow.poll() is None:
            follow.kill()


def test_cancel_over_ssh(laptop, slurm_cluster):
    result = laptop("env_vars.STAGE_SLEEP=120", launch=True)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((laptop.tmp / "state" / "runs" / "gpt3_tiny" / "launch.json").read_text())
    _wait_for(laptop, "RUNNING", timeout=60)  # only scontrol over SSH can say RUNNING
    cancel = laptop("cancel", "gpt3_tiny")
    assert cancel.returncode == 0, cancel.stderr
    assert str(record["stages"][0]["job_id"]) in cancel.stdout
    states = [slurm_cluster.wait_job(str(s["job_id"]), 60) for s in record["stages"]]
    assert states == ["CANCELLED", "CANCELLED"]
    assert "RUNNING" not in _wait_for(laptop, "CANCELLED", count=2)
