"""Pure pieces of the launcher: dependency flags, scontrol parsing, executor choice, local run states, training
progress, and `logs -f` ending with its stage."""

from pathlib import Path

from launcher import launch, runs, slurm
from launcher.config import parse_cluster
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
    options = sbatch_options(parse_cluster({"partition": "p", "exclusive": True, "mem": 0, "exclude": ["a", "b"],
                                            "gres": None}))
    assert options == ["partition=p", "exclusive", "mem=0", "exclude=a,b"]


def test_a_cancelled_local_stage_reads_cancelled_and_the_rest_not_run(tmp_path):
    from launcher import records

    record = {"executor": "local", "pid": None, "created": "2026-01-01T00:00:00+00:00", "stages": [
        {"stage": "training", "exit_code": 75, "job_id": "local", "log_dir": str(tmp_path / "t")},
        {"stage": "conversion", "exit_code": None, "job_id": None, "log_dir": str(tmp_path / "c")},
    ]}
    records.write_cancel(tmp_path, record, ["training"], "SIGUSR1")
    record["cancelled"] = records.cancelled_stages(tmp_path, record)
    states = [str(state) for _, state in runs.stage_states(record)]
    assert states == ["CANCELLED (stopped at a checkpoint)", "NOT RUN (the run was cancelled)"]
    # A later launch of the same run (another `created`) is not the one that was cancelled.
    assert records.cancelled_stages(tmp_path, {**record, "created": "2026-02-01T00:00:00+00:00"}) == []


def test_training_progress_is_step_loss_and_time_left(tmp_path):
    import json

    (tmp_path / "logs").mkdir()
    rows = [{"step": 10, "loss": 5.0, "step_time_s": 2.0}, {"step": 15, "val_loss": 4.9},
            {"step": 20, "loss": 4.25, "step_time_s": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2')
    (tmp_path / "training_config.yaml").write_text("trainer:\n  max_steps: 100\n")
    entry = {"stage": "training", "log_dir": str(tmp_path / "logs"), "config": str(tmp_path / "training_config.yaml")}
    # 80 steps left at the mean of the last rows' step times (3 s): 4 minutes.
    assert runs.training_progress(entry) == "step 20 of 100 (20%), loss 4.2500, about 4m 00s left at 4.00 s/step"
    # With the runtime's memory peaks in the row: how close the run is to a node's memory.
    rows[-1].update(host_peak_gib=4.414, host_peak_rank=3, node_host_peak_gib=17.12)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert runs.training_progress(entry).endswith("at 4.00 s/step; host memory peak 4.41 GiB (rank 3), 17.1 GiB on "
                                                  "the busiest node")
    # On XLA (runtime/graphs.py): graphs and transfers per step, and the compiles after the first record.
    rows[-1].update(xla_compiles=2, xla_recompiles=1, xla_graphs_per_step=1.0, xla_transfers_per_step=1.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert runs.training_progress(entry).endswith("busiest node; XLA: 1 graphs and 1 device-to-host transfers per "
                                                  "step, 1 recompiles after warm-up")
    (tmp_path / "metrics.jsonl").unlink()
    assert runs.training_progress(entry) is None  # not logged a step yet


def test_logs_follow_stops_once_the_stage_has_ended(tmp_path, monkeypatch):
    """`logs -f` on a finished local run prints the whole log and exits (it used to tail -F forever)."""
    from launcher import records

    monkeypatch.setenv("NXDT_USER_CONFIG_DIR", str(tmp_path / "config"))

    from .helpers import nxdt

    run_dir = tmp_path / "results" / "run1"
    logs = run_dir / "training" / "logs"
    logs.mkdir(parents=True)
    (logs / "training_local.log").write_text("step 1 | loss 9\nnxdt: done\n")
    (logs / "training_local.exit").write_text("0\n")
    records.write(run_dir, {"run_name": "run1", "created": "2026-01-01T00:00:00+00:00", "executor": "local",
                            "stages": [{"stage": "training", "job_id": "local", "log_dir": str(logs),
                                        "exit_code": 0, "script": "-", "config": "-"}]})
    result = nxdt("logs", "-f", "run1", "training", "--results-dir", str(tmp_path / "results"), cwd=tmp_path,
                  timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "step 1 | loss 9\nnxdt: done\n"


def test_a_slurm_hostlist_string_is_a_node_list_for_every_launch():
    """cluster.nodelist='node[01-03,7]' as sbatch reads it, in a training launch as in cluster-validate."""
    from launcher import render, validate

    cluster = {"partition": "debug", "nodelist": "node[01-03,7]", "exclude": ["node9", "gpu[1-2]"]}
    assert validate.cluster(parse_cluster(cluster)) == []
    assert "nodelist=node[01-03,7]" in render.sbatch_options(parse_cluster(cluster))
    assert "exclude=node9,gpu[1-2]" in render.sbatch_options(parse_cluster(cluster))
    (error,) = validate.cluster(parse_cluster({"exclude": "node[1-"}))
    assert error.startswith("cluster.exclude: 'node[1-': a '[' is never closed; give a list")
