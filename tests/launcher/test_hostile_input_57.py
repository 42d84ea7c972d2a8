"""Issue 57's hostile-input sweep, kept true: paths no file system holds, a seed numpy refuses, a vocabulary no
embedding holds, a 40 MB alias bomb, a system file given as a config, a key added under the model section that
nothing reads. Each ends in one `error:` line naming the key or file and the fix, exit 2, nothing written. Through
the real CLI, forked (helpers.nxdt)."""

import json
import subprocess
from pathlib import Path

import pytest

from launcher.config_file import EXCERPT_CHARS, MAX_EXPANDED_BYTES, MAX_FILE_BYTES
from runtime.schema import rules

from .helpers import nxdt, refused


def _refused(result, expected: str, cwd) -> list[str]:
    lines = refused(result, expected)
    assert not [p for p in cwd.iterdir() if p.name not in ("configs", "tok.json")], "a refused command wrote files"
    return lines


LONG_NAME = "n" * (rules.NAME_MAX + 1)
LONG_PATH = "/tmp" + "/n" * (rules.PATH_MAX // 2)

PATHS = [
    ("base_results_dir={name}", "base_results_dir: the path's part"),
    ("training.run.results_dir={name}", "training.run.results_dir: the path's part"),
    ("training.exp_manager.checkpoint_callback_params.dirpath={name}",
     "training.exp_manager.checkpoint_callback_params.dirpath: the path's part"),
    ("data_dir={name}", "data_dir: the path's part"),
    ("training.model.tokenizer.model={name}/tokenizer.json", "training.model.tokenizer.model: the path's part"),
    ("base_results_dir=" + LONG_PATH, f"base_results_dir: a path of {len(LONG_PATH):,} bytes is longer than any"),
]


@pytest.mark.parametrize("override,expected", PATHS, ids=[p[1][:40] for p in PATHS])
def test_a_path_no_file_system_holds_is_refused_before_it_is_looked_at(tmp_path, override, expected):
    for dry_run in (["--dry-run"], []):
        args = [override.format(name=f"{tmp_path}/{LONG_NAME}"), "stages=[training]", "cluster_type=local",
                *dry_run]
        if not override.startswith("base_results_dir"):
            args.append(f"base_results_dir={tmp_path}/results")
        lines = _refused(nxdt(*args, cwd=tmp_path), expected, tmp_path)
        assert len(lines) == 1, lines


def test_the_runtime_runs_the_same_path_rule():
    from runtime.schema.training import parse_training

    from .helpers import resolved

    section = resolved("stages=[training]", f"training.run.results_dir=/r/{LONG_NAME}")["training"]
    _, report = parse_training(section, files="error")
    assert report.errors == [rules.path_length(f"/r/{LONG_NAME}", "training.run.results_dir")]


@pytest.mark.parametrize("seed", ["-1", str(rules.SEED_MAX + 1)])
def test_a_seed_numpy_and_torch_refuse_is_refused_at_launch(tmp_path, seed):
    _refused(nxdt(f"training.model.seed={seed}", "stages=[training]", f"base_results_dir={tmp_path}/results",
                  "cluster_type=local", "--dry-run", cwd=tmp_path),
             f"training.model.seed: {seed} must be in [0, {rules.SEED_MAX}]", tmp_path)


@pytest.mark.parametrize("stages", ["[training]", "[data_preparation,training]"])
@pytest.mark.parametrize("cluster", ["local", "slurm"])
def test_a_vocabulary_no_embedding_holds_is_refused_at_launch(tmp_path, stages, cluster):
    """99,999,999,999 tokens: killed natively on the node (a 4.5 TB allocation) where no node memory judged it (a
    Slurm CPU node's is not known), or where this launch's data_preparation makes the tokenizer (the schema does not
    read it then; the estimator does)."""
    tokenizer = write_huge_vocabulary(tmp_path / "tok.json")
    lines = _refused(nxdt(f"training.model.tokenizer.model={tokenizer}", f"stages={stages}",
                          f"base_results_dir={tmp_path}/results", f"cluster_type={cluster}", "--dry-run",
                          cwd=tmp_path),
                     f"training.model.tokenizer.model: '{tokenizer}' has ", tmp_path)
    assert "more than an embedding holds" in lines[0] and len(lines) == 1, lines


def write_huge_vocabulary(path: Path) -> Path:
    """A tokenizer.json whose added token has id 99,999,999,998."""
    path.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                "added_tokens": [{"id": 99_999_999_998, "content": "x"}]}))
    return path


def _bomb() -> str:
    """The sweep's file: a 99 KB string aliased 400 times, 40 MB of text once expanded (explain-config printed it
    for over 500 s), though only 400 values."""
    return "s: &s " + "x" * 99_000 + "\nmodel:\n" + "".join(f"  k{i}: *s\n" for i in range(400))


@pytest.mark.parametrize("entry", ["training", "explain-config"])
def test_an_alias_bomb_of_text_is_refused_by_explain_config_as_by_a_launch(tmp_path, entry):
    (tmp_path / "configs").mkdir()
    text = _bomb()
    assert len(text) < MAX_FILE_BYTES and 99_000 * 400 > MAX_EXPANDED_BYTES
    (tmp_path / "configs" / "bomb.yaml").write_text(text)
    args = ["explain-config", "configs/bomb.yaml"] if entry == "explain-config" else \
        ["training=@configs/bomb.yaml", f"base_results_dir={tmp_path}/results", "--dry-run"]
    lines = _refused(nxdt(*args, cwd=tmp_path, timeout=60),
                     f"configs/bomb.yaml: holds more than {MAX_EXPANDED_BYTES >> 20} MiB of text once its aliases",
                     tmp_path)
    assert len(lines) == 1, lines


PLAIN_TEXTS = [  # (a file given as a config, what its one error line says)
    ("".join(f"user{i}:x:{i}:{i}::/home/user{i}:/bin/sh\n" for i in range(200)), "holds text, not a config mapping"),
    ("k" * 1000 + ": 1\n", "has a key of 1,000 characters"),
]


@pytest.mark.parametrize("text,expected", PLAIN_TEXTS)
def test_an_error_line_quotes_a_bounded_excerpt_of_the_file(tmp_path, text, expected):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "passwd").write_text(text)
    for args in (["training=@configs/passwd", "--dry-run"], ["explain-config", "configs/passwd"]):
        lines = _refused(nxdt(*args, cwd=tmp_path), expected, tmp_path)
        assert len(lines) == 1 and len(lines[0]) < 200 + EXCERPT_CHARS, lines


def test_a_key_added_under_the_model_section_that_nothing_reads_is_refused(tmp_path):
    lines = _refused(nxdt("+training.model.zero_stages=3", "stages=[training]", f"base_results_dir={tmp_path}/results",
                          "cluster_type=local", "--dry-run", cwd=tmp_path),
                     "training.model.zero_stages: unknown key; ", tmp_path)
    assert "zero_stage" in lines[0] and len(lines) == 1, lines


BROKEN_YAML = "model:\n  num_layers: [4, 6\n  hidden_size: 64\n"  # a flow sequence never closed: yaml's ScannerError


def _damaged_checkpoint(checkpoints: Path, config: dict | None = None) -> Path:
    """A complete checkpoint (its COMMIT) whose config.yaml is no longer YAML."""
    step = checkpoints / "step_00000010.0a1b2c3d"
    step.mkdir(parents=True)
    (step / "COMMIT").write_text("{}")
    (step / "config.yaml").write_text(BROKEN_YAML)
    return step / "config.yaml"


def test_a_checkpoint_config_that_is_not_yaml_is_refused_at_launch(tmp_path, recipe_data_dir):
    """The launcher reads the newest checkpoint's config.yaml (is it another model's?): a damaged one is named."""
    path = _damaged_checkpoint(tmp_path / "results" / "gpt3_tiny" / "training" / "checkpoints")
    before = sorted(tmp_path.rglob("*"))
    result = nxdt("stages=[training]", "cluster_type=local", f"base_results_dir={tmp_path}/results",
                  f"data_dir={recipe_data_dir}", cwd=tmp_path)
    [line] = refused(result, f"{path}: not valid YAML at line 3, column 14 (expected ',' or ']'")
    assert "restore it from a copy, or move the checkpoint's directory aside" in line
    assert sorted(tmp_path.rglob("*")) == before, "a refused launch wrote files"


def test_a_checkpoint_config_that_is_not_yaml_is_one_line_on_the_node(tmp_path, capsys):
    """Export reads the config the checkpoint was saved with (runtime.checkpoint.read_config): one line, exit 2."""
    from runtime.convert.__main__ import main

    path = _damaged_checkpoint(tmp_path / "checkpoints")
    config = tmp_path / "conversion_config.yaml"
    config.write_text(json.dumps({"mode": "export", "checkpoint_dir": str(tmp_path / "checkpoints"),
                                  "output_dir": str(tmp_path / "hf")}))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: not valid YAML at line 3, column 14") and "\n" not in err, err
    assert not (tmp_path / "hf").exists()


def write_reused_pid_record(run_dir: Path, pid: int, with_pid_started: bool) -> None:
    """The record of a local launch that ended an hour before the process now holding `pid` started."""
    from datetime import datetime, timezone

    import psutil

    started = psutil.Process(pid).create_time()
    (run_dir / "training").mkdir(parents=True)
    record = {"run_name": run_dir.name, "executor": "local", "pid": pid,
              "created": datetime.fromtimestamp(started - 3600, timezone.utc).isoformat(timespec="seconds"),
              "stages": [{"stage": "training", "job_id": "local", "pid": pid, "exit_code": None,
                          "script": str(run_dir / "training" / "training.local.sh"),
                          "log_dir": str(run_dir / "training" / "log")}]}
    if with_pid_started:
        record["pid_started"] = started - 3600
    (run_dir / "launch.json").write_text(json.dumps(record))


@pytest.mark.parametrize("record_kind", ["pid_started recorded", "record from before pid_started"])
def test_cancel_leaves_alone_a_process_that_was_given_the_launchs_pid(tmp_path, record_kind):
    """The launch ended long ago and the system gave its pid to another program: cancel neither waits for it nor
    tells the user to kill it, and status does not call the run RUNNING."""
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)  # a session of its own: nothing else is hit
    try:
        write_reused_pid_record(tmp_path / "results" / "L", other.pid, record_kind == "pid_started recorded")
        where = ["--results-dir", str(tmp_path / "results")]
        result = nxdt("cancel", "L", *where, "--timeout", "1", cwd=tmp_path, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (f"nothing to cancel: the local launch is not running; its pid {other.pid} "
                                         "now belongs to another process, which is left alone"), result.stdout
        assert "kill" not in result.stdout + result.stderr and other.poll() is None
        status = nxdt("status", "L", *where, cwd=tmp_path, timeout=60)
        assert status.returncode == 0 and "RUNNING" not in status.stdout and "NOT RUN" in status.stdout, status.stdout
    finally:
        other.kill()
        other.wait()


CLUSTER = ["cluster-config", "subnet_id=subnet-0abc", "--no-validate"]
S3_URIS = [
    ("'s3://b/x.sh\nrm -rf ~'", "'s3://b/x.sh\\nrm -rf ~' holds '\\n'; an S3 key here takes no spaces, control"),
    ("'s3://b/$(touch pwned).sh'", "'s3://b/$(touch pwned).sh' holds '$'; an S3 key here takes no spaces"),
    ("s3://My_Bucket/x.sh", "'s3://My_Bucket/x.sh': 'My_Bucket' is not an S3 bucket name"),
    ("s3://bucket", "s3://bucket names a bucket without a key; add the object's path"),
]


@pytest.mark.parametrize("uri,expected", S3_URIS, ids=[u[1][:30] for u in S3_URIS])
def test_cluster_config_refuses_an_s3_uri_no_command_can_hold(tmp_path, uri, expected):
    _refused(nxdt(*CLUSTER, f"node_setup.script_s3_uri={uri}", cwd=tmp_path),
             f"node_setup.script_s3_uri: {expected}", tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_cluster_config_quotes_every_value_it_prints_into_a_command(tmp_path):
    """What `next:` prints runs as shown when pasted: each value one word, whatever it holds."""
    import shlex

    out, uri, region = tmp_path / "my clusters", "s3://b/nxdt/on_node(1).sh", "us-east-1;touch pwned"
    result = nxdt(*CLUSTER, f"node_setup.script_s3_uri='{uri}'", f"region='{region}'", "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: shlex.split(line) for line in result.stdout.splitlines()[2:4]}
    assert lines["aws"] == ["aws", "s3", "cp", str(out / "on_node_configured.sh"), uri], result.stdout
    assert lines["pcluster"] == ["pcluster", "create-cluster", "--cluster-name", "nxdt", "--cluster-configuration",
                                 str(out / "nxdt.yaml"), "--region", region], result.stdout


def write_two_launches(results: Path, data_dir: Path) -> dict[str, str]:
    """Run gpt3_tiny's records as a full local launch and then a stage-only one leave them, each stage's log
    written; returns the log text of each stage."""
    import time

    from launcher import launch, records

    common = ["cluster_type=local", f"base_results_dir={results}", f"data_dir={data_dir}"]
    logs = {}
    for created, stages in (("2026-01-01T00:00:00+00:00", "[training,conversion]"),
                            ("2026-01-02T00:00:00+00:00", "[conversion]")):
        plan = launch.make_plan([f"stages={stages}", *common], dry_run=True, produced_by="test")
        record = {**launch.new_record(plan, [j.results_dir / f"{j.stage}.local.sh" for j in plan.jobs]),
                  "created": created}
        for job, entry in zip(plan.jobs, record["stages"]):  # what run_local records as each stage ends
            entry.update(job_id="local", exit_code=0)
            job.log_dir.mkdir(parents=True, exist_ok=True)
            logs[job.stage] = f"{job.stage} of the launch of {created}\n"
            (job.log_dir / f"{job.stage}_local.log").write_text(logs[job.stage])
        records.archive_previous(plan.run_dir)
        records.write(plan.run_dir, record)
        time.sleep(0.01)  # archives are ordered by their time
    return logs


def test_logs_finds_every_stage_the_run_ever_launched(tmp_path, recipe_data_dir):
    """A full launch, then a stage-only launch of the same run (stages=[conversion]): the second record replaces the
    first (kept as launch.<created>.json), and `logs RUN training` still prints the training's log."""
    logs = write_two_launches(tmp_path / "results", recipe_data_dir)
    where = ["--results-dir", f"{tmp_path}/results"]
    training = nxdt("logs", "gpt3_tiny", "training", *where, cwd=tmp_path)
    assert training.returncode == 0, training.stderr
    assert logs["training"] in training.stdout and "2026-01-01" in training.stdout, training.stdout
    every = nxdt("logs", "gpt3_tiny", *where, cwd=tmp_path)
    assert every.returncode == 0 and logs["training"] in every.stdout and "conversion of the launch of 2026-01-02" \
        in every.stdout, every.stdout
    refused(nxdt("logs", "gpt3_tiny", "evaluation", *where, cwd=tmp_path),
            "stage 'evaluation' is not part of run 'gpt3_tiny'; its stages: conversion, training")


def write_live_record(run_dir: Path) -> Path:
    """A live local run: its launcher (this process) started before its record was created."""
    import os

    run_dir.mkdir(parents=True)
    (run_dir / "launch.json").write_text(json.dumps({
        "run_name": run_dir.name, "executor": "local", "pid": os.getpid(), "created": "2999-01-01T00:00:00+00:00",
        "stages": [{"stage": "training", "job_id": "local", "log_dir": str(run_dir / "training" / "logs"),
                    "exit_code": None}]}))
    return run_dir


def test_dry_runs_of_a_live_run_leave_one_directory_not_one_each(tmp_path, monkeypatch):
    """A dry run of a live run renders under a new nxdt-dry-run-<run>-* directory (the run's files must not change);
    the next one removes it, so that they do not pile up in the temporary directory. Another run's stays."""
    import os
    import tempfile
    import time

    from launcher import paths

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    results = tmp_path / "results"
    run_dir = write_live_record(results / "gpt3_tiny")
    other = Path(tempfile.mkdtemp(prefix="nxdt-dry-run-gpt3_tiny-b-"))  # run gpt3_tiny-b's
    args = ["stages=[training]", "cluster_type=local", f"base_results_dir={results}", "--dry-run"]
    made = []
    for _ in range(3):
        result = nxdt(*args, cwd=tmp_path, env={"TMPDIR": str(temp)})
        assert result.returncode == 0 and "this dry run wrote its files under" in result.stdout, result.stderr
        made.append(next(p for p in temp.iterdir() if p not in made and p != other))
        past = time.time() - 2 * paths.DRY_RUN_KEEP_S
        for directory in (made[-1], other):
            os.utime(directory, (past, past))
    assert sorted(temp.iterdir()) == sorted([made[-1], other]), "earlier dry runs' directories were kept"
    assert (made[-1] / str(run_dir).lstrip("/") / "training" / "training_config.yaml").is_file()
