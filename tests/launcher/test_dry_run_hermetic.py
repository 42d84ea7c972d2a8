"""A dry run renders whatever the cluster's state and whatever data is not prepared yet, and says what it could not
check (one `not checked: ...` line each on stderr); the real run keeps those checks and refuses with one line.

Both documented commands run here as a user types them on a fresh head node: in an empty directory, with no
prepared data, and with a fake Slurm first on PATH (tests/fake_slurm.py: slurm.conf found, sinfo answers, no trn1
node idle, sbatch refuses) or with no Slurm at all. They run in this process (launcher.cli.run), as the docs test
runs them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.cli import run
from tests import fake_slurm


@pytest.fixture
def head_node(tmp_path, monkeypatch):
    """An empty working directory and, first on PATH, a fake Slurm whose slurm.conf is found (cluster_type=auto
    picks Slurm, as on a ParallelCluster head node). Returns the file each fake command logs its calls to."""
    fake, conf, calls = fake_slurm.install(tmp_path)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return calls


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """An empty working directory on a machine without any Slurm command or config."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)


def nxdt(capsys, *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _not_checked(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("not checked: ")]


def _one_error(code: int, err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (code, err)


# ------------------------------------------------------------------------------------------------ cluster-validate
JOB_DIR = Path("results/cluster_validation/cluster_validation")


def test_cluster_validate_dry_run_renders_on_a_head_node_with_no_idle_node(head_node, capsys):
    code, out, err = nxdt(capsys, "cluster-validate", "cluster=pcluster_trn1", "--dry-run")
    assert code == 0, err
    script = (JOB_DIR / "cluster_validation.sbatch").resolve()
    assert f"script: {script}" in out and "slurm executor" in out
    assert script.read_text() in out, "the dry run prints the script it rendered"
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --partition=trn1\n" in out and "--nodelist" not in out
    (line,) = _not_checked(err)
    assert "which nodes of partition trn1 are idle" in line and "rendered for 2 nodes" in line
    assert "cluster_validation.nodes=N" in line
    assert not head_node.exists(), "a dry run does not ask Slurm"
    assert "error" not in err


def test_cluster_validate_real_run_still_refuses_when_no_node_is_idle(head_node, capsys):
    code, _, err = nxdt(capsys, "cluster-validate", "cluster=pcluster_trn1")
    _one_error(code, err, "cluster_validation.nodes: no idle node in partition trn1; set cluster_validation.nodes=N")
    assert head_node.read_text().splitlines() == ["sinfo -h -N -t idle -o %N -p trn1"], "asked, and nothing submitted"
    assert not _not_checked(err)


def test_cluster_validate_dry_run_renders_with_no_slurm_at_all(no_slurm, capsys):
    # For a cluster's Slurm (cluster_type=slurm) from a machine without one: rendered, idle nodes not checked.
    code, out, err = nxdt(capsys, "cluster-validate", "cluster=pcluster_trn1", "cluster_type=slurm", "--dry-run")
    assert code == 0, err
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --partition=trn1\n" in out
    (line,) = _not_checked(err)
    assert "which nodes of partition trn1 are idle" in line
    # Without cluster_type, this machine is validated (the local executor): nothing about a cluster to check.
    code, out, err = nxdt(capsys, "cluster-validate", "cluster=pcluster_trn1", "--dry-run")
    assert code == 0, err
    assert "local executor (cluster_type=auto: no Slurm here)" in out and "#!/bin/bash" in out
    assert not _not_checked(err)
    # The real run asks sinfo, which is not there: one line naming the key and the fix.
    code, _, err = nxdt(capsys, "cluster-validate", "cluster=pcluster_trn1", "cluster_type=slurm")
    _one_error(code, err, "sinfo failed")
    assert "set cluster_validation.nodes=N or cluster.nodelist=[...]" in err


# ------------------------------------------------------------------------------------------------ autoconfig
@pytest.mark.parametrize("argv", [["autoconfig", "--dry-run"], ["--dry-run", "autoconfig"],
                                  ["autoconfig", "dry_run=true"]], ids=["option", "group option", "override"])
def test_autoconfig_dry_run_sizes_for_the_tokenizer_data_preparation_will_train(head_node, capsys, argv):
    code, out, err = nxdt(capsys, *argv)
    assert code == 0, err
    # The demo tokenizer's 4096 tokens size the same model as when it is there (tests/autoconfig/test_search.py).
    assert "4 layers, hidden 128" in out and "valid and within memory" in out
    (line,) = _not_checked(err)
    tokenizer = Path("data/demo/tokenizer.json").resolve()
    assert f"training.model.tokenizer.model: {tokenizer} does not exist yet" in line
    assert "the model is sized for the 4096 tokens it will have (data_preparation.tokenizer.train.vocab_size)" in line
    assert not Path("results").exists() and not head_node.exists(), "nothing launched, Slurm not asked"


def test_autoconfig_dry_run_with_no_slurm_at_all(no_slurm, capsys):
    code, out, err = nxdt(capsys, "autoconfig", "--dry-run")
    assert code == 0, err
    assert "4 layers, hidden 128" in out
    assert len(_not_checked(err)) == 1


def test_autoconfig_real_run_still_refuses_without_the_tokenizer(head_node, capsys):
    code, _, err = nxdt(capsys, "autoconfig")
    tokenizer = Path("data/demo/tokenizer.json").resolve()
    _one_error(code, err, f"error: training.model.tokenizer.model: {tokenizer} does not exist; prepare it first "
                          "(nxdt-launch stages=[data_preparation]")
    assert not _not_checked(err) and not Path("results").exists() and not head_node.exists()


def test_autoconfig_dry_run_refuses_a_vocabulary_it_cannot_know(head_node, capsys):
    """A tokenizer no data_preparation here makes, not on this machine and of no known name: the model cannot be
    sized, so even a dry run stops, with the rule's own line and the key that sizes it without the file."""
    code, _, err = nxdt(capsys, "autoconfig", "--dry-run", "training.model.tokenizer.model=/nowhere/tokenizer.json")
    _one_error(code, err, "training.model.tokenizer.model: /nowhere/tokenizer.json does not exist")
    assert "set search_config.train_settings.vocab_size=N" in err
