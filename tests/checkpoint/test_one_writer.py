# Two launches of one run: while the first trains (it holds <results_dir>/RUNNING), the second is refused on one
# line before it writes anything, `status` names the holder, and the first finishes with every step logged once.
import json
import subprocess
import sys
import time

import pytest

from tests.checkpoint.launch_helpers import counting_corpus, training_overrides
from tests.launcher.helpers import nxdt


@pytest.mark.slow
def test_a_second_launch_of_a_running_run_is_refused(tmp_path):
    data = counting_corpus(tmp_path / "data")
    overrides = ["cluster_type=local", *training_overrides(data, tmp_path / "results", steps=60, every=30)]
    run_dir = tmp_path / "results" / "gpt3_tiny" / "training"
    first = subprocess.Popen([sys.executable, "-m", "launcher.cli", *overrides], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "RUNNING").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (run_dir / "RUNNING").exists(), "the first launch should be training by now"
        config = run_dir / "training_config.yaml"
        written = config.stat().st_mtime_ns
        second = nxdt(*overrides, cwd=tmp_path, timeout=120)
        status = nxdt("status", "gpt3_tiny", f"--results-dir={tmp_path / 'results'}", cwd=tmp_path, timeout=60)
    finally:
        output, _ = first.communicate(timeout=600)
    assert second.returncode == 2, second.stdout + second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"training.run.results_dir: {run_dir} is being trained by pid " in errors[0]
    assert "Traceback" not in second.stdout + second.stderr
    assert config.stat().st_mtime_ns == written, "the refused launch wrote nothing"
    assert "training is held by pid" in status.stdout, status.stdout + status.stderr
    assert first.returncode == 0, output[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 61)), "one writer: every step once"
    assert not (run_dir / "RUNNING").exists(), "released on exit"
