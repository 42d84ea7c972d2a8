"""Two launches of one run started together (issue 57): both pass make_plan's look, since neither has a record yet;
the one that comes second to the run's launch lock writes nothing, and the first one's config link, config and
script stay its own."""

import pytest

from launcher import launch, records
from launcher.errors import UserError


def _plan(tmp_path, lr):
    return launch.make_plan(["stages=[data_preparation,training]", f"base_results_dir={tmp_path}/results",
                             f"data_dir={tmp_path}/data", "cluster_type=local", f"training.model.optim.lr={lr}"],
                            dry_run=False, produced_by=f"test lr {lr}")


def _files(run_dir):
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(run_dir.rglob("*")) if not p.is_dir() or p.is_symlink()}


def test_the_launch_that_loses_the_race_writes_nothing(tmp_path):
    first, second = _plan(tmp_path, 0.003), _plan(tmp_path, 0.001)
    assert first.run_dir == second.run_dir
    scripts = launch.write(first)
    before = _files(first.run_dir)
    assert (first.run_dir / "training" / "training_config.yaml").resolve().read_text().count("lr: 0.003") == 1
    with pytest.raises(UserError) as refused:
        launch.write(second)
    assert str(refused.value).startswith("run_name: run gpt3_tiny is being launched by pid ")
    assert "this launch wrote nothing" in str(refused.value)
    assert _files(first.run_dir) == before and second.files == []
    # Once the first has its record (run_local writes it before any stage runs) and lets the lock go, the second is
    # refused by that record, still writing nothing.
    record = launch.new_record(first, scripts)
    record["pid"] = __import__("os").getpid()
    records.write(first.run_dir, record)
    first.launch_lock.close()
    before = _files(first.run_dir)
    with pytest.raises(UserError) as refused:
        launch.write(second)
    assert str(refused.value).startswith("run_name: run gpt3_tiny is live (its local launch (pid ")
    assert _files(first.run_dir) == before


def test_a_refused_first_launch_leaves_no_run_directory(tmp_path, monkeypatch):
    """The lock is taken where the run directory will be; a launch refused under it removes what it made."""
    plan = _plan(tmp_path, 0.003)
    monkeypatch.setattr(launch.live, "locked", lambda jobs: launch.live.Live("a test's hold", "run_name"))
    with pytest.raises(UserError, match="is live"):
        launch.write(plan)
    assert not (tmp_path / "results").exists()
