"""launcher/live.py's reading of a run's record, in process: a local launcher that still runs keeps its run live and
a pid the system has given to a later process does not; a Slurm run that Slurm cannot be asked about is treated as
live. (A live run end to end: tests/checkpoint/test_one_writer.py, and the Slurm cluster's in
tests/launcher/test_slurm_integration.py.)"""

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone

from launcher import live, slurm


def _record(run_dir, **fields):
    run_dir.mkdir(parents=True)
    stage = {"stage": "training", "job_id": "local", "log_dir": str(run_dir / "training" / "logs"), "exit_code": None}
    (run_dir / "launch.json").write_text(json.dumps({"run_name": run_dir.name, "stages": [stage], **fields}))


def _iso(when: datetime) -> str:
    return when.isoformat(timespec="seconds")


def test_a_running_local_launcher_keeps_its_run_live_and_a_reused_pid_does_not(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = datetime.now(timezone.utc)
        _record(tmp_path / "a", executor="local", pid=launcher.pid, created=_iso(now + timedelta(seconds=1)))
        found = live.recorded(str(tmp_path), "a")
        assert found and f"its local launch (pid {launcher.pid}" in found.what and found.key == "run_name"
        # The same pid, recorded by a launch an hour before that process started: the system reused the number.
        _record(tmp_path / "b", executor="local", pid=launcher.pid, created=_iso(now - timedelta(hours=1)))
        assert live.recorded(str(tmp_path), "b") is None
    finally:
        launcher.kill()
        launcher.wait()
    assert live.recorded(str(tmp_path), "a") is None, "its launcher is gone"


def test_a_slurm_run_that_slurm_cannot_be_asked_about_is_live(tmp_path, monkeypatch):
    def no_slurm(cmd):  # stands in for a machine without Slurm's commands: what slurm._run raises there
        raise slurm.SlurmError(f"{cmd[0]} not found on PATH on this machine: is it a Slurm login node?")

    monkeypatch.setattr(slurm, "_run", no_slurm)
    _record(tmp_path / "a", executor="slurm", created=_iso(datetime.now(timezone.utc)))
    found = live.recorded(str(tmp_path), "a")
    assert found and "Slurm cannot be asked from here: scontrol not found" in found.what
    assert "nxdt-launch cancel a" in live.refusal("a", found)


def test_no_record_or_no_run_directory_yet_is_not_live(tmp_path):
    assert live.recorded(str(tmp_path), "nothing") is None
    assert live.recorded(None, "a") is None and live.recorded(str(tmp_path), None) is None
    assert live.recorded(str(tmp_path), "x" * 5000) is None  # output_problems names the over-long name


def test_a_run_name_that_holds_another_models_checkpoints_is_refused_before_anything_is_written(tmp_path,
                                                                                              recipe_data_dir):
    """NxD Training's hf_llama files all name their run hf_llama: the second model launched under it would resume
    from the first one's checkpoints. A real launch is refused (one line naming the differing keys); a dry run
    warns; the same model resumes as ever."""
    from launcher import launch
    from launcher.errors import UserError

    stage_dir = tmp_path / "gpt3_tiny" / "training"
    common = ["stages=[training]", "cluster_type=local", f"base_results_dir={tmp_path}", f"data_dir={recipe_data_dir}"]
    first = launch.make_plan(common, dry_run=True, produced_by="test")
    checkpoint = stage_dir / "checkpoints" / "step_00000010.0a1b2c3d"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMMIT").write_text("{}")
    import yaml

    (checkpoint / "config.yaml").write_text(yaml.safe_dump(first.cfg["training"]))  # what the checkpoint keeps
    # A dry run of another model has pointed the directory's training_config.yaml at its own config: no matter.
    (stage_dir / "training_config.yaml").write_text(yaml.safe_dump({"model": {"num_layers": 6}}))
    launch.make_plan(common, dry_run=False, produced_by="test")  # the same model: it resumes
    other = [*common, "training.model.num_layers=6"]
    try:
        launch.make_plan(other, dry_run=False, produced_by="test")
        raise AssertionError("a launch into another model's checkpoints was not refused")
    except UserError as error:
        [line] = str(error).splitlines()
        assert line.startswith("training.run.name: 'gpt3_tiny' already holds checkpoints of another model") and \
            "num_layers 4 there, 6 here" in line
    assert any("already holds checkpoints of another model" in w
               for w in launch.make_plan(other, dry_run=True, produced_by="test").warnings)
