# Two launches of one run: while the first trains, a dry run of the same launch renders elsewhere and changes no file
# of the run, the same launch for real is refused on one line by the launcher before it writes anything, `status`
# names the lock's holder, and the first finishes COMPLETED with every step logged once (launcher/live.py).
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoint.launch_helpers import counting_corpus, training_overrides
from tests.launcher.helpers import nxdt, pids_with

STEPS = 20


@pytest.mark.slow
def test_a_second_launch_of_a_running_run_is_refused(tmp_path):
    data = counting_corpus(tmp_path / "data")
    # One worker (torchrun's and its): what is under test is the launch, not the ranks' training.
    overrides = ["cluster_type=local", *training_overrides(data, tmp_path / "results", steps=STEPS, every=10,
                                                           extra=("training.trainer.devices=1",))]
    run_dir = tmp_path / "results" / "gpt3_tiny" / "training"
    # The first launch trains while the other launches act, however loaded the machine: its workers are stopped
    # (SIGSTOP) as soon as it holds the run's lock, and continued once they are done. A pause after each step (no
    # CPU) leaves seconds to find them in before the run could end.
    first = subprocess.Popen([sys.executable, "-m", "launcher.cli", *overrides], cwd=tmp_path,
                             env={**os.environ, "NXDT_STEP_PAUSE_S": "0.15"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "RUNNING").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = _stop_workers(tmp_path)
        assert len(stopped) >= 2 and (run_dir / "RUNNING").exists(), "the first launch should be training by now"
        before = _checksums(tmp_path / "results")
        # The case: a dry run trying another learning rate, while the run trains at its own.
        dry = nxdt(*overrides, "training.model.optim.lr=0.5", "--dry-run", cwd=tmp_path, timeout=120)
        dry_after = _checksums(tmp_path / "results")
        started = time.monotonic()
        second = nxdt(*overrides, cwd=tmp_path, timeout=120)
        refused_in = time.monotonic() - started
        second_after = _checksums(tmp_path / "results")
        status = nxdt("status", "gpt3_tiny", f"--results-dir={tmp_path / 'results'}", cwd=tmp_path, timeout=60)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        output, _ = first.communicate(timeout=600)
    # The dry run: its files are under a fresh directory it names, each at the run's path below it; the run's own
    # launch files (what it would have rewritten, and every other file the launch wrote) are byte for byte the same.
    assert dry.returncode == 0, dry.stdout + dry.stderr
    mirror = Path(re.search(r"this dry run wrote its files under (\S+) ", dry.stdout.replace("\n", " ")).group(1))
    rendered = [p for p in mirror.rglob("*") if p.is_file()]
    assert {p.name for p in rendered} >= {"training_config.yaml", "training.local.sh"}, rendered
    assert "lr: 0.5" in (mirror / run_dir.relative_to("/") / "training_config.yaml").read_text()
    launch_files = {Path("/") / p.relative_to(mirror) for p in rendered} | {run_dir.parent / "launch.json"}
    assert all(before[p] == dry_after[p] for p in launch_files if p in before), "a dry run rewrote a live run's file"
    assert {p for p in launch_files if p in before} >= {run_dir / "training_config.yaml", run_dir.parent / "launch.json"}
    assert dry_after == before, "the dry run wrote into the run"
    # The real one: refused by the launcher (not by its worker, after starting torchrun), naming the live run.
    assert second.returncode == 2, second.stdout + second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "run_name: run gpt3_tiny is live (its local launch (pid " in errors[0], errors
    assert "nxdt-launch cancel gpt3_tiny" in errors[0]
    assert "Traceback" not in second.stdout + second.stderr
    assert second_after == dry_after, "the refused launch wrote"
    print(f"refused by the launcher in {refused_in:.2f} s")
    assert "training is held by pid" in status.stdout, status.stdout + status.stderr
    assert first.returncode == 0, output[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, STEPS + 1)), "one writer: every step once"
    assert not (run_dir / "RUNNING").exists(), "released on exit"
    assert "COMPLETED" in nxdt("status", "gpt3_tiny", f"--results-dir={tmp_path / 'results'}", cwd=tmp_path).stdout
    # Once it is over, a launch renders into the run again, beside it: the finished launch's config (under its own
    # launches/<id>/, which its record names) stays what it ran; training_config.yaml links to the newest.
    ran = Path(json.loads((run_dir.parent / "launch.json").read_text())["stages"][0]["config"])
    ran_text = ran.read_text()
    after = nxdt(*overrides, "training.model.optim.lr=0.5", "--dry-run", cwd=tmp_path, timeout=120)
    assert after.returncode == 0 and "is live" not in after.stdout, after.stdout + after.stderr
    assert ran.parent.parent == run_dir / "launches" and ran.read_text() == ran_text and "lr: 0.5" not in ran_text
    assert "lr: 0.5" in (run_dir / "training_config.yaml").read_text()


def _stop_workers(root: Path) -> list[int]:
    """SIGSTOP torchrun and the runtime.train workers of the launch under `root`; their pids."""
    stopped = []
    for pid in pids_with("runtime.train", str(root)):
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.append(pid)
    return stopped


def _checksums(root: Path) -> dict[Path, str]:
    """Every file under `root` but what the running training itself adds and rewrites meanwhile (its logs, metrics,
    checkpoints, data index and lock), by content."""
    sums = {}
    for p in root.rglob("*"):
        if {"logs", "checkpoints", "index"} & set(p.relative_to(root).parts) or p.name in ("metrics.jsonl", "RUNNING"):
            continue
        try:
            sums[p] = hashlib.sha256(p.read_bytes()).hexdigest()
        except (IsADirectoryError, FileNotFoundError):
            continue
    return sums
