"""Runs are found by name from any directory: records.write (every launch record) adds the run to an index in the
user's config directory (NXDT_USER_CONFIG_DIR here, a tmp dir), and status/logs/cancel ask it when the run is not
under the results directory. Two run directories of one name are ambiguous: both are named, and --results-dir
chooses."""

import json

import pytest

from launcher import records, run_index

from .helpers import nxdt


def _record(run_dir, executor="local"):
    return {"run_name": run_dir.name, "created": "2026-01-01T00:00:00+00:00", "executor": executor,
            "stages": [{"stage": "training", "job_id": "local", "log_dir": str(run_dir / "training" / "logs"),
                        "exit_code": 0, "script": "-", "config": "-"}]}


@pytest.fixture
def index_dir(tmp_path, monkeypatch):
    folder = tmp_path / "config"
    monkeypatch.setenv(run_index.ENV, str(folder))
    return folder


def test_writing_a_record_indexes_the_run_once(tmp_path, index_dir):
    run_dir = tmp_path / "somewhere" / "gpt3_tiny"
    for _ in range(3):  # a local launch rewrites its record after every stage
        records.write(run_dir, _record(run_dir))
    assert run_index.lookup("gpt3_tiny") == [run_dir]
    assert json.loads((index_dir / "runs.json").read_text())["runs"] == {"gpt3_tiny": [str(run_dir)]}


def test_runs_whose_record_is_gone_are_skipped_and_dropped(tmp_path, index_dir):
    kept, gone = tmp_path / "a" / "run1", tmp_path / "b" / "run2"
    records.write(kept, _record(kept))
    records.write(gone, _record(gone))
    (gone / "launch.json").unlink()
    assert run_index.lookup("run2") == [] and run_index.all_runs() == [kept]
    other = tmp_path / "c" / "run3"
    records.write(other, _record(other))
    assert set(json.loads((index_dir / "runs.json").read_text())["runs"]) == {"run1", "run3"}


def test_a_damaged_index_is_replaced_not_fatal(tmp_path, index_dir):
    index_dir.mkdir()
    (index_dir / "runs.json").write_text('{"runs": {"x": ')
    assert run_index.lookup("x") == []
    run_dir = tmp_path / "r" / "x"
    records.write(run_dir, _record(run_dir))
    assert run_index.lookup("x") == [run_dir]


def test_an_unwritable_index_warns_and_the_record_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(run_index.ENV, "/proc/nope")
    run_dir = tmp_path / "r" / "x"
    records.write(run_dir, _record(run_dir))
    assert (run_dir / "launch.json").exists()
    assert "warning: could not record run 'x' in /proc/nope/runs.json" in capsys.readouterr().err


def test_status_and_logs_find_an_indexed_run_from_another_directory(tmp_path, index_dir):
    run_dir = tmp_path / "somewhere" / "gpt3_tiny"
    records.write(run_dir, _record(run_dir))
    (run_dir / "training" / "logs").mkdir(parents=True)
    (run_dir / "training" / "logs" / "training_local.log").write_text("step 1 | loss 9\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {run_index.ENV: str(index_dir)}
    status = nxdt("status", "gpt3_tiny", cwd=elsewhere, env=env)
    assert status.returncode == 0, status.stderr
    assert "COMPLETED" in status.stdout
    logs = nxdt("logs", "gpt3_tiny", cwd=elsewhere, env=env)
    assert logs.returncode == 0 and "step 1 | loss 9" in logs.stdout, logs.stderr
    listing = nxdt("status", cwd=elsewhere, env=env)
    assert listing.returncode == 0 and "gpt3_tiny" in listing.stdout and str(run_dir.parent) in listing.stdout
    # --results-dir means there and only there.
    named = nxdt("status", "gpt3_tiny", "--results-dir", str(elsewhere), cwd=elsewhere, env=env)
    assert named.returncode == 2 and "run 'gpt3_tiny': no launch.json under" in named.stderr


def test_a_name_launched_under_two_results_dirs_names_both(tmp_path, index_dir):
    first, second = tmp_path / "one" / "gpt3_tiny", tmp_path / "two" / "gpt3_tiny"
    records.write(first, _record(first))
    records.write(second, _record(second))
    result = nxdt("status", "gpt3_tiny", cwd=tmp_path, env={run_index.ENV: str(index_dir)})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run 'gpt3_tiny' was launched under 2 results "
                                                   f"directories: {first.parent}, {second.parent}; choose one "
                                                   "with --results-dir"), result.stderr
    chosen = nxdt("status", "gpt3_tiny", "--results-dir", str(second.parent), cwd=tmp_path,
                  env={run_index.ENV: str(index_dir)})
    assert chosen.returncode == 0, chosen.stderr
