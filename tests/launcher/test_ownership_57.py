"""Issue 57, items 1 and 2: no launch resumes from, writes into, prunes or deletes a directory of a run it is not
(runtime/io/ownership.py, asked by launcher/launch.py before anything is written and by the runtime where it would
resume, prune or delete), and a launch refused under the run's lock leaves nothing behind. Each case of the issue that
lost data is marked `# data loss`; the lost race of two launches of one run is tests/launcher/test_launch_race.py.
Reading another run's checkpoints stays open: an export or evaluation of them, and a training that starts from one by
exp_manager.resume_from_checkpoint (read only)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from launcher import launch, live, records
from launcher.errors import UserError
from runtime.io import ownership
from tests.checkpoint.launch_helpers import counting_corpus, losses, training_overrides
from tests.launcher.helpers import REPO, nxdt, pids_with, refused

STEPS = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return counting_corpus(tmp_path_factory.mktemp("data"))


def _overrides(data: Path, results: Path, run: str, *extra: str) -> list[str]:
    """A tiny GPT on one worker, a checkpoint every 10 steps: the runs of this file (run_name `run`)."""
    small = [o for o in training_overrides(data, results, steps=STEPS, every=10, hidden=32) if "batch_size" not in o]
    return ["cluster_type=local", f"run_name={run}", *small, "training.model.global_batch_size=2",
            "training.model.micro_batch_size=2", "training.trainer.devices=1", *extra]


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*")) if not p.is_dir() or p.is_symlink()}


@pytest.fixture
def finished(tmp_path, corpus):
    return write_finished(tmp_path / "results", corpus)


def write_finished(results: Path, corpus: Path) -> tuple[Path, Path]:
    """A finished run L as its launch leaves it (its files, record and ownership), with two checkpoints of steps 10
    and 20 in its checkpoint directory (markers of complete ones: nothing here loads them): (run dir, checkpoints)."""
    plan = launch.make_plan(_overrides(corpus, results, "L"), dry_run=False, produced_by="test")
    scripts = launch.write(plan)
    records.write(plan.run_dir, launch.new_record(plan, scripts))
    plan.launch_lock.close()
    checkpoints = plan.run_dir / "training" / "checkpoints"
    for step in (10, 20):
        (checkpoints / f"step_{step:08d}.0a1b2c3d").mkdir(parents=True)
        (checkpoints / f"step_{step:08d}.0a1b2c3d" / "COMMIT").write_text("{}")
    return plan.run_dir, checkpoints


def _plan(tmp_path, corpus, run, *extra, dry_run=False):
    return launch.make_plan(_overrides(corpus, tmp_path / "results", run, *extra), dry_run=dry_run, produced_by="test")


# ---- at launch ---------------------------------------------------------------------------------------------------

def test_a_training_of_another_run_into_a_runs_checkpoints_is_refused(tmp_path, corpus, finished):
    # data loss: it resumed from L's step and wrote its own steps among L's; L's resume then found nothing to train.
    run_dir, checkpoints = finished
    before = _tree(tmp_path / "results")
    result = nxdt(*_overrides(corpus, tmp_path / "results", "L3",
                              f"training.exp_manager.checkpoint_callback_params.dirpath={checkpoints}"), timeout=120)
    [line] = refused(result, f"training.exp_manager.checkpoint_callback_params.dirpath: {checkpoints} belongs to "
                             f"run L ({run_dir})")
    assert f"training.exp_manager.resume_from_checkpoint={checkpoints}" in line, line
    assert _tree(tmp_path / "results") == before and not (tmp_path / "results" / "L3").exists()


def test_a_training_with_save_top_k_into_another_runs_checkpoints_is_refused(tmp_path, corpus, finished):
    # data loss: it resumed from the finished run's newest step and its save_top_k=1 deleted that run's steps 10, 20.
    _, checkpoints = finished
    with pytest.raises(UserError, match="would resume from its checkpoints, save among them and prune them"):
        _plan(tmp_path, corpus, "L3", f"training.exp_manager.checkpoint_callback_params.dirpath={checkpoints}",
              "training.exp_manager.checkpoint_callback_params.save_top_k=1")
    # A dry run says so as well; starting from one of its checkpoints by the read-only key is a launch like any other.
    with pytest.raises(UserError, match="belongs to run L"):
        _plan(tmp_path, corpus, "L3", f"training.exp_manager.checkpoint_callback_params.dirpath={checkpoints}",
              dry_run=True)
    step = sorted(checkpoints.iterdir())[-1]
    plan = _plan(tmp_path, corpus, "L3", f"training.exp_manager.resume_from_checkpoint={step}",
                 "training.exp_manager.checkpoint_callback_params.save_top_k=1")
    assert plan.jobs[0].stage_config["exp_manager"]["resume_from_checkpoint"] == str(step)


def test_an_import_into_another_runs_checkpoints_is_refused(tmp_path, corpus, finished):
    # data loss: the import wrote its step_00000000 among L's checkpoints.
    run_dir, checkpoints = finished
    before = _tree(tmp_path / "results")
    result = nxdt("stages=[conversion]", "cluster_type=local", f"base_results_dir={tmp_path / 'results'}",
                  "run_name=L4", "conversion.mode=import", f"conversion.checkpoint_dir={checkpoints}",
                  f"conversion.hf_checkpoint_dir={tmp_path / 'hf'}", timeout=120)
    refused(result, f"conversion.checkpoint_dir: {checkpoints} belongs to run L ({run_dir})")
    assert _tree(tmp_path / "results") == before


def _output_dirs(run_dir: Path, checkpoints: Path) -> dict[str, Path | str]:
    """The issue's six output_dir values that an export with overwrite deleted its own checkpoints by."""
    return {"checkpoints": checkpoints, "a step": sorted(checkpoints.iterdir())[-1], "training": checkpoints.parent,
            "run": run_dir, "results": run_dir.parent, "working directory": "."}


@pytest.mark.parametrize("where", ["checkpoints", "a step", "training", "run", "results", "working directory"])
def test_an_export_that_would_overwrite_its_own_checkpoints_is_refused_at_launch(tmp_path, corpus, finished,
                                                                                monkeypatch, where):
    # data loss: conversion.overwrite=true deleted the checkpoints it was exporting (exit 0 for the first three).
    run_dir, checkpoints = finished
    monkeypatch.chdir(tmp_path)
    output = _output_dirs(run_dir, checkpoints)[where]
    before = _tree(tmp_path / "results")
    with pytest.raises(UserError) as error:
        launch.make_plan(["stages=[conversion]", "cluster_type=local", f"base_results_dir={tmp_path / 'results'}",
                          "run_name=L", f"conversion.output_dir={output}", "conversion.overwrite=true"],
                         dry_run=False, produced_by="test")
    [line] = str(error.value).splitlines()
    assert line.startswith(f"conversion.output_dir: {output} holds ") and "which overwrite would delete" in line, line
    assert _tree(tmp_path / "results") == before


def test_a_refused_launch_into_an_existing_run_directory_leaves_no_lock_file(tmp_path, corpus, monkeypatch):
    """Refused under the run's lock (here: a training of the same directory holds its RUNNING lock), a launch into a
    run directory that had no lock file takes its own away again: it leaves the directory as it found it."""
    run_dir = tmp_path / "results" / "L"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("the user's")
    before = _tree(run_dir)
    plan = _plan(tmp_path, corpus, "L")
    monkeypatch.setattr(live, "locked", lambda jobs: live.Live("a test's hold", "run_name"))
    with pytest.raises(UserError, match="is live"):
        launch.write(plan)
    assert _tree(run_dir) == before and plan.launch_lock is None
    assert not (run_dir / live.LAUNCH_LOCK).exists() and not (run_dir / ownership.OWNER).exists()


def test_a_checkpoint_directory_outside_the_run_is_recorded_as_the_runs(tmp_path, corpus):
    """The run owns its checkpoint directory wherever it is: recorded by its first real launch (not by a dry run),
    kept by its relaunches, refused to another run, and left alone (with the run directory) by a refused launch."""
    shared = tmp_path / "fsx" / "checkpoints" / "A"
    key = f"training.exp_manager.checkpoint_callback_params.dirpath={shared}"
    launch.write(_plan(tmp_path, corpus, "A", key, dry_run=True))
    assert not (shared / ownership.OWNER).exists()
    first = _plan(tmp_path, corpus, "A", key)
    launch.write(first)
    first.launch_lock.close()
    recorded = ownership.recorded_at(shared)
    assert recorded == ownership.recorded_at(tmp_path / "results" / "A") and recorded.run_name == "A"
    again = _plan(tmp_path, corpus, "A", key)  # its own relaunch
    launch.write(again)
    again.launch_lock.close()
    assert ownership.recorded_at(shared) == recorded
    with pytest.raises(UserError, match=f"dirpath: {shared} belongs to run A"):
        _plan(tmp_path, corpus, "B", key)
    # Two launches that both passed the look: the one that records second is refused, and writes nothing.
    other = tmp_path / "fsx" / "checkpoints" / "C"
    late = _plan(tmp_path, corpus, "D", f"training.exp_manager.checkpoint_callback_params.dirpath={other}")
    ownership.claim(other, ownership.Owner("c0ffee", "C", str(tmp_path / "results" / "C")))
    with pytest.raises(UserError, match=f"dirpath: {other} belongs to run C .* claimed it while this launch started"):
        launch.write(late)
    assert not (tmp_path / "results" / "D").exists()


def test_the_launchers_ownership_checks_import_no_torch(tmp_path, finished):
    """Refused as a launch, in an interpreter where torch and numpy cannot be imported: the launcher's path."""
    run_dir, checkpoints = finished
    code = ("import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
            "from launcher.cli import run\n"
            f"sys.exit(run(['stages=[conversion]', 'cluster_type=local', 'base_results_dir={run_dir.parent}', "
            f"'run_name=L', 'conversion.output_dir={checkpoints}', 'conversion.overwrite=true', '--dry-run']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    refused(result, f"conversion.output_dir: {checkpoints} holds")


# ---- in the runtime: a stage started by hand is held to the same rule ------------------------------------------

@pytest.fixture
def imported(tmp_path):
    """A run L's checkpoint directory holding one checkpoint of a tiny GPT (imported, as a user would make one)."""
    from runtime.convert import save_hf_directory
    from runtime.convert.__main__ import import_hf
    from runtime.models import ModelConfig, build_model
    from runtime.schema.conversion import parse_conversion
    from tests.convert.test_hf import SMALL, _tokenizer

    _tokenizer(tmp_path / "tokenizer.json", ("<|endoftext|>",))
    cfg = ModelConfig(vocab_size=320, architecture="gpt", **SMALL)
    save_hf_directory(tmp_path / "hf", build_model(cfg).state_dict(), cfg, str(tmp_path / "tokenizer.json"))
    run_dir = tmp_path / "results" / "L"
    ownership.claim(run_dir, ownership.Owner("0123abcd", "L", str(run_dir)))
    checkpoints = run_dir / "training" / "checkpoints"
    import_hf(parse_conversion({"mode": "import", "checkpoint_dir": str(checkpoints),
                                "hf_checkpoint_dir": str(tmp_path / "hf")})[0])
    return run_dir, checkpoints


@pytest.mark.parametrize("where", ["checkpoints", "a step", "training", "run", "results", "working directory"])
def test_an_export_that_would_overwrite_its_own_checkpoints_is_refused_by_the_runtime(tmp_path, imported,
                                                                                     monkeypatch, capsys, where):
    # data loss: `python -m runtime.convert` with overwrite deleted the checkpoint it was exporting.
    from runtime.convert.__main__ import main

    run_dir, checkpoints = imported
    monkeypatch.chdir(tmp_path)
    output = _output_dirs(run_dir, checkpoints)[where]
    config = tmp_path / "conversion_config.yaml"
    config.write_text(yaml.safe_dump({"mode": "export", "checkpoint_dir": str(checkpoints), "output_dir": str(output),
                                      "overwrite": True}))
    before = _tree(tmp_path / "results")
    assert main(["--config", str(config)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: conversion.output_dir: {output} holds ") and "overwrite would delete" in line, line
    assert _tree(tmp_path / "results") == before
    # Where the overwrite deletes nothing of a run's, it replaces as before.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("replace me")
    config.write_text(yaml.safe_dump({"mode": "export", "checkpoint_dir": str(checkpoints), "output_dir": str(theirs),
                                      "overwrite": True}))
    assert main(["--config", str(config)]) == 0 and (theirs / "model.safetensors").exists()


# ---- a live run, and the launches pointed into it ---------------------------------------------------------------

@pytest.fixture(scope="module")
def disturbed(tmp_path_factory, corpus):
    """Run L trains 40 steps (a checkpoint every 10) while, once its step 10 is committed, other runs' launches point
    into it: a training at its checkpoint directory, an import into it, an export over it with overwrite (launched,
    and run as the stage's program by hand). Run R trains the same 40 steps undisturbed, meanwhile."""
    from runtime.convert import save_hf_directory
    from runtime.convert.__main__ import main as convert
    from runtime.models import ModelConfig, build_model
    from tests.convert.test_hf import SMALL, _tokenizer

    root = tmp_path_factory.mktemp("live")
    results = root / "results"
    _tokenizer(root / "tokenizer.json", ("<|endoftext|>",))
    cfg = ModelConfig(vocab_size=320, architecture="gpt", **SMALL)
    save_hf_directory(root / "hf", build_model(cfg).state_dict(), cfg, str(root / "tokenizer.json"))
    from tests.checkpoint.launch_helpers import train_rendered

    started = time.monotonic()
    run = subprocess.Popen([sys.executable, "-m", "launcher.cli", *_overrides(corpus, results, "L")], cwd=root,
                           # One intra-op thread, as the reference's forked rank has (tests/runtime_parallel/dist_utils)
                           env={**os.environ, "PYTHONPATH": str(REPO), "NXDT_STEP_PAUSE_S": "0.05",
                                "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checkpoints = results / "L" / "training" / "checkpoints"
    stopped: list[int] = []

    def hold() -> None:
        """L's trainer is held where it is once its step 10 is committed (SIGSTOP: its launcher still runs, the run
        stays live) while the other launches act, however long they take on a loaded machine."""
        while not list(checkpoints.glob("step_00000010.*/COMMIT")) and run.poll() is None:
            if time.monotonic() - started > 240:
                return
            time.sleep(0.05)
        stopped.extend(pid for pid in pids_with("runtime.train", str(results / "L")) if _signal(pid, signal.SIGSTOP))

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        # The undisturbed run R, its config as the launcher renders it, trained by ranks forked from this process.
        reference = launch.make_plan(_overrides(corpus, results, "R"), dry_run=True, produced_by="test")
        launch.write(reference)
        alone = train_rendered(reference.jobs[0].config_path)
        holder.join(timeout=300)
        before = sorted(p.name for p in checkpoints.iterdir())
        attempts = {
            "training": nxdt(*_overrides(corpus, results, "L3",
                                         f"training.exp_manager.checkpoint_callback_params.dirpath={checkpoints}"),
                             cwd=root, timeout=120),
            "import": nxdt("stages=[conversion]", "cluster_type=local", f"base_results_dir={results}", "run_name=L4",
                           "conversion.mode=import", f"conversion.checkpoint_dir={checkpoints}",
                           f"conversion.hf_checkpoint_dir={root / 'hf'}", cwd=root, timeout=120),
            "export": nxdt("stages=[conversion]", "cluster_type=local", f"base_results_dir={results}", "run_name=L5",
                           f"conversion.checkpoint_dir={checkpoints}", f"conversion.output_dir={checkpoints}",
                           "conversion.overwrite=true", cwd=root, timeout=120),
        }
        by_hand = root / "conversion_config.yaml"
        by_hand.write_text(yaml.safe_dump({"mode": "export", "checkpoint_dir": str(checkpoints),
                                           "output_dir": str(checkpoints), "overwrite": True}))
        exported_by_hand = convert(["--config", str(by_hand)])
        still_live = run.poll() is None and len(stopped) >= 1
        after = sorted(p.name for p in checkpoints.iterdir())
    finally:
        holder.join(timeout=300)
        for pid in stopped:
            _signal(pid, signal.SIGCONT)
        output = run.communicate(timeout=300)[0]
    return {"results": results, "attempts": attempts, "by_hand": exported_by_hand, "still_live": still_live,
            "before": before, "after": after, "output": output, "codes": {"L": run.returncode, "R": alone},
            "seconds": time.monotonic() - started}


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def test_a_live_run_with_other_launches_pointed_into_it_trains_as_if_alone(disturbed):
    # data loss: each of these launches once wrote into, resumed from or deleted a live run's checkpoints.
    results = disturbed["results"]
    assert disturbed["codes"] == {"L": 0, "R": [0]}, disturbed["output"][-3000:]
    assert disturbed["still_live"], "L finished before the other launches were done: they did not meet a live run"
    checkpoints = results / "L" / "training" / "checkpoints"
    attempts = disturbed["attempts"]
    refused(attempts["training"], f"training.exp_manager.checkpoint_callback_params.dirpath: {checkpoints} belongs "
                                  f"to run L")
    refused(attempts["import"], f"conversion.checkpoint_dir: {checkpoints} belongs to run L")
    refused(attempts["export"], f"conversion.output_dir: {checkpoints} belongs to run L")
    assert disturbed["by_hand"] == 2  # the stage's own program, run by hand, refuses the overwrite too
    # L went on saving meanwhile; nothing else came or went (an import's step_00000000 has its own token).
    token = disturbed["before"][0].split(".")[1]
    assert set(disturbed["before"]) <= set(disturbed["after"]), "another launch deleted L's checkpoints"
    assert {name.split(".")[1] for name in disturbed["after"] if name.startswith("step_")} == {token}
    assert not any((results / name).exists() for name in ("L3", "L4", "L5"))
    ours, alone = losses(results / "L" / "training"), losses(results / "R" / "training")
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert ours == alone, "L's losses differ from the undisturbed run's"  # bitwise: floats as JSON wrote them
    assert sorted(p.name.split(".")[0] for p in checkpoints.iterdir() if p.is_dir()) == [
        f"step_{step:08d}" for step in (10, 20, 30, 40)]
    print(f"two runs and the launches against one of them: {disturbed['seconds']:.1f} s")


def test_a_trainer_started_by_hand_refuses_another_runs_checkpoint_directory(tmp_path, corpus, disturbed):
    # data loss: with save_top_k=1 it resumed from the finished run's newest step and deleted its other steps.
    from tests.checkpoint.launch_helpers import train_rendered

    theirs = tmp_path / "F"  # a finished run F: a copy of L's checkpoints
    ownership.claim(theirs, ownership.Owner("f1f1f1f1", "F", str(theirs)))
    checkpoints = theirs / "training" / "checkpoints"
    shutil.copytree(disturbed["results"] / "L" / "training" / "checkpoints", checkpoints)
    before = _tree(theirs)
    plan = _plan(tmp_path, corpus, "M", dry_run=True)
    launch.write(plan)
    config = plan.jobs[0].config_path
    section = yaml.safe_load(config.read_text())
    section["trainer"]["max_steps"] = 50  # ten steps past F's newest: then a save, then save_top_k's pruning
    section["exp_manager"].update(resume_if_exists=True)
    section["exp_manager"]["checkpoint_callback_params"].update(dirpath=str(checkpoints), save_top_k=1)
    config.write_text(yaml.safe_dump(section))
    assert train_rendered(config) == [2]
    assert _tree(theirs) == before
    metrics = plan.jobs[0].results_dir / "metrics.jsonl"
    assert not metrics.exists() or "loss" not in metrics.read_text(), "it trained"
