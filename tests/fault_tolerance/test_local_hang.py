"""The real trainer under the local executor's watchdog: rank 1 hangs in step 4's checkpoint section (an injected
fault), and the watchdog in runtime.torchrun ends the stage within the checkpoint timeout, with one line naming rank,
host and section, and the rank that waits for it. The timing rule on both sides of each timeout is
tests/fault_tolerance/test_watchdog.py's; the restarts are the Slurm script's (test_fault_tolerance_slurm.py)."""
import os
import re
import socket

from tests.checkpoint.launch_helpers import counting_corpus, training_overrides
from tests.launcher.helpers import nxdt


def test_a_rank_hung_in_a_checkpoint_save_ends_the_stage_with_its_name(tmp_path, monkeypatch):
    data = counting_corpus(tmp_path / "data")
    monkeypatch.setenv("NXDT_INJECT_FAULT", "hang:rank=1:step=4:section=checkpoint")
    result = nxdt("cluster_type=local", *training_overrides(data, tmp_path / "results", steps=8, every=4, extra=(
        "training.trainer.devices=2", "env_vars.OMP_NUM_THREADS=1",
        "training.fault_tolerance.step_timeout_floor_s=2", "training.fault_tolerance.checkpoint_timeout_s=6",
        "training.fault_tolerance.setup_timeout_s=120")), cwd=tmp_path, timeout=300)
    log = (tmp_path / "results" / "gpt3_tiny" / "training" / "logs" / "training_local.log").read_text()
    assert result.returncode != 0 and "exit code 124" in result.stdout + result.stderr, log[-3000:]
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    line = re.search(rf"nxdt: hang: rank 1 on {re.escape(host)} made no progress in section checkpoint \(step 4\) "
                     r"for (\d+) s, over its 6 s timeout \(checkpoint_timeout_s\); stuck at .*progress\.py.*; "
                     r"1 other rank\(s\) wait for it in a collective; stopping the workers", log)
    assert line and 6 <= int(line.group(1)) < 20, log[-3000:]
    assert "step 3/8" in log and "step 5/8" not in log
