"""Pure pieces of the launcher: dependency flags, scontrol parsing, executor choice, local run states."""

from pathlib import Path

from launcher import launch, runs, slurm
from launcher.render import sbatch_options

SCONTROL = """JobId=7 ArrayJobId=7 ArrayTaskId=0 JobName=nxdt:r:data_preparation
   JobState=COMPLETED Reason=None Dependency=(null)
   NodeList=node1

JobId=8 ArrayJobId=7 ArrayTaskId=1 JobName=nxdt:r:data_preparation
   JobState=FAILED Reason=NonZeroExitCode Dependency=(null)
"""


def test_dependencies_default_to_afterok_and_kill_on_invalid():
    assert slurm.dependency_flag("afterok", None) == []
    assert slurm.dependency_flag("afterok", "12") == ["--dependency=afterok:12", "--kill-on-invalid-dep=yes"]
    assert slurm.dependency_flag("afterany", "12")[0] == "--dependency=afterany:12"
    assert slurm.dependency_flag("singleton", "12")[0] == "--dependency=afterok:12,singleton"
    assert slurm.dependency_flag("singleton", None) == ["--dependency=singleton"]


def test_array_state_is_the_worst_task():
    records = slurm._parse_scontrol(SCONTROL)
    assert [r["JobState"] for r in records] == ["COMPLETED", "FAILED"]
    combined = slurm._combine([slurm.JobState(r["JobState"], r["Reason"]) for r in records])
    assert str(combined) == "FAILED (NonZeroExitCode)"


def test_exit_files_give_the_state_without_accounting(tmp_path):
    (tmp_path / "a.exit").write_text("0\n")
    assert slurm.from_exit_files([tmp_path / "a.exit"]).state == "COMPLETED"
    (tmp_path / "b.exit").write_text("137\n")
    assert str(slurm.from_exit_files([tmp_path / "a.exit", tmp_path / "b.exit"])) == "FAILED (exit 137)"
    assert slurm.from_exit_files([]).state == "UNKNOWN"


def test_auto_picks_slurm_only_with_sbatch_and_a_config(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    assert launch.choose_executor("auto")[0] == "local"
    sbatch = tmp_path / "sbatch"
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(0o755)
    assert launch.choose_executor("auto")[0] == "local"  # sbatch alone is not a cluster
    (tmp_path / "slurm.conf").write_text("")
    assert launch.choose_executor("auto")[0] == "slurm"
    assert launch.choose_executor("bcm")[0] == "slurm"
    assert launch.choose_executor("local")[0] == "local"


def test_local_states_follow_the_recorded_exit_codes():
    record = {"executor": "local", "pid": None, "stages": [
        {"stage": "data_preparation", "exit_code": 0, "job_id": "local", "log_dir": "/x"},
        {"stage": "training", "exit_code": 1, "job_id": "local", "log_dir": "/x"},
        {"stage": "conversion", "exit_code": None, "job_id": "local", "log_dir": "/x"},
    ]}
    states = [str(state) for _, state in runs.stage_states(record)]
    assert states[0] == "COMPLETED" and states[1] == "FAILED (exit 1)" and states[2].startswith("NOT RUN")


def test_sbatch_options_in_a_fixed_order_and_flags_alone():
    options = sbatch_options({"partition": "p", "exclusive": True, "mem": 0, "exclude": ["a", "b"], "gres": None})
    assert options == ["partition=p", "exclusive", "mem=0", "exclude=a,b"]
