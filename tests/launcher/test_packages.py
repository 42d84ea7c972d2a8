"""The packages a launch needs from the jobs' Python (launcher/packages.py), with what is installed here hidden
one module at a time: each missing one is one line naming the key that asks for it and how to get it, an error at a
launch and a warning in a dry run, and nothing is claimed about an interpreter the launcher cannot look at."""

import pytest

from launcher import launch, packages
from launcher.config import parse
from launcher.errors import UserError

from .helpers import resolved


@pytest.fixture
def missing(monkeypatch):
    """Hide these modules from packages.importable (find_spec still answers for everything else)."""
    hidden: set[str] = set()
    real = packages.importable
    monkeypatch.setattr(packages, "importable", lambda module: module not in hidden and real(module))
    return hidden


def test_each_optional_package_is_named_by_the_key_that_wants_it(missing, tmp_path):
    (tmp_path / "in").mkdir()
    for name in ("a.jsonl.zst", "b.parquet"):
        (tmp_path / "in" / name).write_bytes(b"")
    missing.update({"wandb", "tensorboard", "zstandard", "pyarrow", "torch"})
    cfg = resolved("stages=[data_preparation,training]", "data_preparation=custom_dataset", "python=null",
                   "data_preparation.input.source=files", f"data_preparation.input.files=[{tmp_path}/in/*]",
                   "training.exp_manager.create_wandb_logger=true")
    lines = packages.problems(parse(cfg))
    assert any(line.startswith("training.exp_manager.create_wandb_logger: true needs the wandb package") for line in lines)
    assert any(line.startswith("training.exp_manager.create_tensorboard_logger: true needs the tensorboard package")
               for line in lines)
    assert any(line.startswith(f"data_preparation.input: {tmp_path}/in/a.jsonl.zst (.zst) needs the zstandard")
               for line in lines)
    assert any("needs the pyarrow package" in line and "nxdt-launch[parquet]" in line for line in lines)
    torch = [line for line in lines if "needs the torch package" in line]
    assert len(torch) == 1 and torch[0].startswith("stages: training needs the torch package"), "once each"


def test_another_interpreter_is_not_judged_by_this_one(missing):
    missing.add("wandb")
    wandb = "training.exp_manager.create_wandb_logger=true"
    assert packages.problems(parse(resolved("stages=[training]", wandb, "python=null")))
    for other in ("python=/opt/other/bin/python", "container=nvcr.io/x:1", "+cluster.remote.host=head",
                  "cluster=pcluster_trn1"):  # its cluster.venv, /opt/nxdt/venv, is what the job runs
        assert packages.problems(parse(resolved("stages=[training]", wandb, other))) == [], other


def test_missing_is_an_error_at_launch_and_a_warning_in_a_dry_run(missing, recipe_data_dir, tmp_path):
    missing.add("tensorboard")
    overrides = ["stages=[training]", "cluster_type=local", "python=null", f"data_dir={recipe_data_dir}",
                 f"base_results_dir={tmp_path}/results"]
    plan = launch.make_plan(overrides, dry_run=True, produced_by="test")
    assert any("needs the tensorboard package" in w for w in plan.warnings)
    with pytest.raises(UserError) as caught:
        launch.make_plan(overrides, dry_run=False, produced_by="test")
    assert any("create_tensorboard_logger: true needs the tensorboard package" in p for p in caught.value.problems)
    assert not (tmp_path / "results").exists()
