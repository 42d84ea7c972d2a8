# The kill test: a run whose rank 1 is killed with SIGKILL after the step-6 checkpoint, relaunched through the
# launcher, ends bitwise equal to a run that was never interrupted (fp32, CPU, 2 processes, local executor).
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.checkpoint import committed_checkpoints, open_storage
from tests.checkpoint.launch_helpers import (counting_corpus, final_weights, losses, train_rendered,
                                            training_overrides)
from tests.launcher.helpers import REPO, nxdt

STEPS, EVERY = 12, 6
# A pause after each step of the runs that are killed (runtime/train.py: no CPU, no effect on any result): the kill,
# sent once the step-EVERY checkpoint is committed, has seconds to land before step STEPS however loaded the machine.
PAUSE = {"NXDT_STEP_PAUSE_S": "0.15"}


def _worker_pid(config: Path, rank: int) -> int | None:
    """The runtime.train process with RANK=rank started for this config."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runtime.train" in cmdline and str(config).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _kill_after_checkpoint(proc: subprocess.Popen, checkpoints, config: Path, rank: int) -> int | None:
    """SIGKILL the worker `rank` as soon as the step-EVERY checkpoint is committed; its pid, or None."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if any(c.step == EVERY for c in committed_checkpoints(checkpoints)):
            # A launch's workers read its own config (launches/<id>/), which training_config.yaml links to.
            launched = config.parent / os.readlink(config) if config.is_symlink() else config
            victim = _worker_pid(launched, rank=rank)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                return victim
        time.sleep(0.01)
    return None


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run both tests compare with: its corpus is data/, its results straight/gpt3_tiny/training/
    (losses, final checkpoint, and the training_config.yaml torchrun is given). The launcher renders it (--dry-run)
    and its two ranks are forked from this process: the runs under test are the killed ones."""
    root = tmp_path_factory.mktemp("kill")
    data = counting_corpus(root / "data")
    result = nxdt("cluster_type=local", *_overrides(data, root / "straight"), "--dry-run", cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert train_rendered(root / "straight" / "gpt3_tiny" / "training" / "training_config.yaml") == [0, 0]
    return root


def _overrides(data: Path, results: Path) -> list[str]:
    return training_overrides(data, results, steps=STEPS, every=EVERY)


@pytest.mark.slow
@pytest.mark.long("a killed run and its relaunch, compared bit for bit with the uninterrupted one")
def test_kill_minus_nine_then_relaunch_is_bitwise_equal(straight, tmp_path):
    killed = _overrides(straight / "data", tmp_path / "killed")
    run_dir = tmp_path / "killed" / "gpt3_tiny" / "training"
    config = run_dir / "training_config.yaml"
    checkpoints = open_storage(run_dir / "checkpoints")
    launcher = subprocess.Popen([sys.executable, "-m", "launcher.cli", "cluster_type=local", *killed], cwd=tmp_path,
                                env={**os.environ, **PAUSE}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    victim = _kill_after_checkpoint(launcher, checkpoints, config, rank=1)
    output, _ = launcher.communicate(timeout=300)
    assert victim is not None, output[-3000:]
    assert launcher.returncode != 0, "the killed run should fail"
    seen = losses(run_dir)
    assert EVERY in seen and STEPS not in seen, f"the kill should land between steps {EVERY} and {STEPS}: {sorted(seen)}"
    assert [c.step for c in committed_checkpoints(checkpoints)] == [EVERY]

    result = nxdt("cluster_type=local", *killed, cwd=tmp_path, timeout=600)  # the same command again
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr

    expected, got = losses(straight / "straight" / "gpt3_tiny" / "training"), losses(run_dir)
    assert [got[s] for s in range(EVERY + 1, STEPS + 1)] == [expected[s] for s in range(EVERY + 1, STEPS + 1)]
    step_a, weights_a = final_weights(str(straight / "straight" / "gpt3_tiny" / "training" / "checkpoints"))
    step_b, weights_b = final_weights(str(run_dir / "checkpoints"))
    assert step_a == step_b == STEPS and weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert weights_a[name].dtype == weights_b[name].dtype and (weights_a[name] == weights_b[name]).all(), name


@pytest.mark.slow
@pytest.mark.long("torchrun restarts killed workers in place; they must resume and finish the run")
def test_torchrun_restart_in_place_resumes_and_finishes(straight, tmp_path):
    """Within one allocation: torchrun --max-restarts brings the workers back after a SIGKILL; they rendezvous
    again (torchrun gives every attempt a fresh store) and resume from the newest checkpoint."""
    import yaml

    raw = yaml.safe_load((straight / "straight" / "gpt3_tiny" / "training" / "training_config.yaml").read_text())
    run_dir = tmp_path / "restarted"
    raw["run"]["results_dir"] = str(run_dir)
    config = tmp_path / "restarted.yaml"
    config.write_text(yaml.safe_dump(raw))
    checkpoints = open_storage(run_dir / "checkpoints")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "--max-restarts", "1", "-m", "runtime.train", "--config", str(config)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **PAUSE})
    victim = _kill_after_checkpoint(proc, checkpoints, config, rank=0)
    output, _ = proc.communicate(timeout=300)
    assert victim is not None and proc.returncode == 0, output[-4000:]
    assert "resumed from" in output
    expected, got = losses(straight / "straight" / "gpt3_tiny" / "training"), losses(run_dir)
    assert [got[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]
