# The checkpoint directory's file system, found wanting: read-only, too small to start, or filling up during the
# run. Each is a real tmpfs mounted for the test (root only: skipped, with the reason, where mounting is not
# allowed). Training stops with one `error:` line naming the directory; checkpoints already committed stay intact.
import subprocess
from pathlib import Path

import pytest

from runtime.checkpoint import committed_checkpoints, open_storage
from runtime.checkpoint.integrity import check_checkpoint
from tests.checkpoint.launch_helpers import counting_corpus, losses, train_rendered, training_overrides
from tests.launcher.helpers import nxdt

KEEP_ALL = "training.exp_manager.checkpoint_callback_params.save_top_k=-1"


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str, *, read_only: bool = False) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): needs root")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _run(tmp_path, capfd, dirpath: Path, steps: int, every: int) -> tuple[list[int], str]:
    """Every rank's exit code and the run's output. The launcher renders the run (--dry-run) and its two ranks are
    forked from this process: what is under test is the trainer's check and its one line (a failed worker's
    way out through torchrun is tests/runtime_train/test_torchrun.py's, a real launch's end test_pipeline's)."""
    data = counting_corpus(tmp_path / "data")
    overrides = training_overrides(data, tmp_path / "results", steps=steps, every=every,
                                   extra=(f"training.exp_manager.checkpoint_callback_params.dirpath={dirpath}",
                                          KEEP_ALL))
    rendered = nxdt("cluster_type=local", *overrides, "--dry-run", cwd=tmp_path, timeout=600)
    assert rendered.returncode == 0, rendered.stdout[-3000:] + rendered.stderr[-3000:]
    capfd.readouterr()
    codes = train_rendered(tmp_path / "results" / "gpt3_tiny" / "training" / "training_config.yaml")
    return codes, "".join(capfd.readouterr())


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_a_read_only_checkpoint_directory_stops_before_the_first_step(tmp_path, tmpfs, capfd):
    ro = tmpfs("1m", read_only=True)
    codes, output = _run(tmp_path, capfd, ro, steps=4, every=2)
    assert codes == [2, 2], codes  # a setting to fix: every rank stops with 2
    errors = _errors(output)
    assert errors and errors[0] == (f"error: exp_manager.checkpoint_callback_params.dirpath: {ro} is not writable "
                                    f"(Read-only file system); fix its permissions or point it elsewhere"), output[-3000:]
    assert not losses(tmp_path / "results" / "gpt3_tiny" / "training"), "no step ran"


@pytest.mark.slow
def test_too_little_room_for_one_checkpoint_stops_before_the_first_step(tmp_path, tmpfs, capfd):
    small = tmpfs("1m")
    codes, output = _run(tmp_path, capfd, small, steps=4, every=2)
    assert codes == [2, 2], codes
    errors = _errors(output)
    assert errors and f"dirpath: {small} has " in errors[0] and "free but one checkpoint needs" in errors[0], output
    assert not losses(tmp_path / "results" / "gpt3_tiny" / "training"), "no step ran"


@pytest.mark.slow
def test_a_disk_filling_up_mid_run_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, tmpfs, capfd):
    # ~5 MiB per checkpoint of this model: two fit in 12 MiB, the third does not.
    disk = tmpfs("12m")
    codes, output = _run(tmp_path, capfd, disk, steps=8, every=2)
    assert all(codes), codes
    errors = _errors(output)
    assert errors and f"checkpoint save to {disk} failed: no space left on device" in errors[0], output[-3000:]
    assert "the previous checkpoint is kept" in errors[0]
    assert not [line for line in output.splitlines() if line.strip().startswith("File ") and "/runtime/" in line]
    storage = open_storage(disk)
    kept = committed_checkpoints(storage)
    assert [c.step for c in kept] == [2, 4]
    assert all(check_checkpoint(storage, c) is None for c in kept), "what was committed is intact"
