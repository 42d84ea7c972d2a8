"""runtime.torchrun: real torchrun agents and workers; a failed run ends in one line and the worker's exit code."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.torchrun import exit_code, root_cause

REPO = Path(__file__).resolve().parents[2]

# Rank 0 fails the way the runtime does on a user mistake (one `error:` line, exit 2, or 75 for a checkpointed
# stop); rank 1 is still working when torchrun stops it.
WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
code = int(sys.argv[1])
if rank == 0:
    time.sleep(0.5)
    print("error: training.model.hidden_size: must be divisible by num_attention_heads", file=sys.stderr)
    sys.exit(code)
time.sleep(60)
"""


def torchrun(tmp_path: Path, *program: str, **popen) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "runtime.torchrun", "--standalone", "--nproc_per_node", "2",
                             str(script), *program], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


@pytest.mark.parametrize("code", [2, 75])
def test_a_failed_worker_ends_in_one_line_with_its_exit_code(tmp_path: Path, code: int):
    proc = torchrun(tmp_path, str(code))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert "error: training.model.hidden_size" in out
    last = out.strip().splitlines()[-1]
    assert last == f"nxdt: worker rank 0 exited with {code}; its output above says why; exiting {code}", out


def test_a_signalled_torchrun_stops_its_workers_without_a_traceback(tmp_path: Path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time, pathlib, os\n"
                      "pathlib.Path(f'started_{os.environ[\"RANK\"]}').touch()\n"
                      "time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.torchrun", "--standalone", "--nproc_per_node", "2",
                             str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"started_{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == "nxdt: torchrun received SIGTERM; the workers were stopped", out


def test_exit_codes_read_as_a_shell_reports_them():
    assert exit_code(2) == 2
    assert exit_code(75) == 75
    assert exit_code(-9) == 137  # killed by SIGKILL
    assert exit_code(-15) == 143
    assert exit_code(0) == 1  # a "failure" with status 0 is still a failure
    assert exit_code(300) == 1


def test_the_root_cause_is_not_a_worker_torchrun_stopped():
    from types import SimpleNamespace as F
    # rank 0 got torchrun's SIGTERM in the same second rank 1 failed
    assert root_cause({0: F(exitcode=-15, timestamp=5), 1: F(exitcode=2, timestamp=5)})[0] == 1
    assert root_cause({0: F(exitcode=-15, timestamp=5), 1: F(exitcode=-15, timestamp=4)})[0] == 1
    assert root_cause({0: F(exitcode=-9, timestamp=5), 1: F(exitcode=-15, timestamp=5)})[0] == 0  # OOM kill
