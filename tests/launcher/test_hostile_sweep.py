"""Issue 57's sweep, kept in the suite: one table of hostile inputs of every kind the issue found (paths no file system
holds, seeds, vocabularies, alias bombs, system files as configs, keys nothing reads, damaged checkpoint configs,
recycled pids, S3 URIs, stage-only relaunches, dry runs of live runs, launches into another run's directories), each run through the real CLI entry point
(launcher.cli.run, in a forked copy of this process: helpers.nxdt, so that a hang is killed and counted, not hung)
and classified:

    clean refusal       exit != 0, stderr is one `error:` line holding what the case says
    correct acceptance  exit 0, stdout holds what the case says, and the case's own check holds
    traceback           a Python traceback anywhere in the output
    silent acceptance   exit 0 where the case must be refused, or accepted doing the wrong thing
    unclear refusal     exit != 0 without the one `error:` line the case says
    hang                still running after the case's timeout
    data loss           a file the case lists as `untouched` changed or vanished

The counter test asserts that only the first two occur. The inputs come from the tests of each case
(test_hostile_input_57.py): a case is added here by one row. Cases that need a training process or the node's own
program are covered by the tests named in COVERED_ELSEWHERE (test_the_list_of_cases_covered_elsewhere_is_true
keeps that list true)."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import shlex
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from launcher.config_file import MAX_EXPANDED_BYTES
from runtime.schema import rules

from tests.checkpoint.launch_helpers import counting_corpus

from . import test_hostile_input_57 as cases57
from . import test_ownership_57 as own57
from .helpers import REPO, nxdt

OK = ("clean refusal", "correct acceptance")
Setup = Callable[[Path, Path], contextlib.AbstractContextManager]  # (case directory, recipe data) -> values


@dataclass(frozen=True)
class Case:
    kind: str                  # the words for the class of input
    name: str
    argv: tuple[str, ...] | Callable[[dict], list[str]]  # formatted with d (the case's directory), data (recipe
    #                          data) and the setup's values; or made from them
    says: str                  # refusal: in its error line; acceptance: in stdout (formatted likewise)
    refuse: bool = True
    setup: Setup | None = None
    check: Callable[[Path, subprocess.CompletedProcess], bool] | None = None  # more an acceptance must do
    untouched: tuple[str, ...] = ()  # globs under the case's directory whose files must not change
    timeout: float = 30


def files(**named: str) -> Setup:
    """A setup writing these files (path under the case directory -> text)."""
    def setup(d: Path, data: Path):
        for name, text in named.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
        return contextlib.nullcontext({})
    return setup


def _huge_vocabulary(d: Path, data: Path):
    cases57.write_huge_vocabulary(d / "tok.json")
    return contextlib.nullcontext({})


def _damaged_checkpoint(d: Path, data: Path):
    cases57._damaged_checkpoint(d / "results" / "gpt3_tiny" / "training" / "checkpoints")
    return contextlib.nullcontext({})


@contextlib.contextmanager
def _reused_pid(d: Path, data: Path):
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        cases57.write_reused_pid_record(d / "results" / "L", other.pid, with_pid_started=True)
        yield {"pid": other.pid}
    finally:
        other.kill()
        other.wait()


def _two_launches(d: Path, data: Path):
    cases57.write_two_launches(d / "results", data)
    return contextlib.nullcontext({})


@contextlib.contextmanager
def _live_run_with_an_old_dry_run(d: Path, data: Path):
    """A live run, and the directory an earlier dry run of it left an hour ago, in a temporary directory of the
    case's own (the forked CLI keeps this process's tempfile.tempdir)."""
    cases57.write_live_record(d / "results" / "gpt3_tiny")
    (d / "tmp").mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(d / "tmp")
    try:
        old = Path(tempfile.mkdtemp(prefix="nxdt-dry-run-gpt3_tiny-"))
        os.utime(old, (time.time() - 3600, time.time() - 3600))
        yield {"old": old}
    finally:
        tempfile.tempdir = before


def _finished_run(d: Path, data: Path):
    """Another run L, finished, with its checkpoints (test_ownership_57.write_finished), and a corpus to train on."""
    corpus = counting_corpus(d / "corpus")
    run_dir, checkpoints = own57.write_finished(d / "results", corpus)
    return contextlib.nullcontext({"corpus": corpus, "run": run_dir, "ckpt": checkpoints})


def _training_of_run(run: str, *extra: str) -> Callable[[dict], list[str]]:
    return lambda v: own57._overrides(v["corpus"], v["d"] / "results", run, *(e.format(**v) for e in extra))


def _one_dry_run_directory(d: Path, result) -> bool:
    return len(list((d / "tmp").iterdir())) == 1  # the new one: the old one is gone


def _each_value_one_word(d: Path, result) -> bool:
    aws = next(line for line in result.stdout.splitlines() if line.strip().startswith("aws s3 cp"))
    return shlex.split(aws)[-1] == "s3://b/nxdt/on_node(1).sh"


TRAINING = ("stages=[training]", "cluster_type=local", "base_results_dir={d}/results")
DRY = (*TRAINING, "--dry-run")
BOMB = f"configs/bomb.yaml: holds more than {MAX_EXPANDED_BYTES >> 20} MiB of text once its aliases"

CASES = [
    *(Case("a path over the OS limit", says[:45], (override.format(name=f"{{d}}/{cases57.LONG_NAME}"),
           *(DRY if not override.startswith("base_results_dir") else DRY[:2] + DRY[3:])), says)
      for override, says in cases57.PATHS),
    *(Case("a seed numpy refuses", f"seed {seed}", (f"training.model.seed={seed}", *DRY),
           f"training.model.seed: {seed} must be in [0, {rules.SEED_MAX}]") for seed in ("-1", str(rules.SEED_MAX + 1))),
    Case("a vocabulary no embedding holds", "vocab_size 99,999,999,999",
         ("training.model.tokenizer.model={d}/tok.json", *DRY), "more than an embedding holds", setup=_huge_vocabulary),
    *(Case("an alias bomb", f"alias bomb through {entry[0]}", entry, BOMB, setup=files(**{"configs/bomb.yaml": cases57._bomb()}))
      for entry in (("explain-config", "configs/bomb.yaml"), ("training=@configs/bomb.yaml", *DRY[1:]))),
    *(Case("a system file given as a config", f"{says[:20]} through {entry[0]}", entry, says,
           setup=files(**{"configs/passwd": text}))
      for text, says in cases57.PLAIN_TEXTS for entry in (("training=@configs/passwd", "--dry-run"),
                                                          ("explain-config", "configs/passwd"))),
    Case("a key added under a section the schema owns", "+training.model.zero_stages=3",
         ("+training.model.zero_stages=3", *DRY), "training.model.zero_stages: unknown key; "),
    Case("a checkpoint config.yaml that is not YAML", "damaged config.yaml at launch",
         (*TRAINING, "data_dir={data}"), "config.yaml: not valid YAML at line 3", setup=_damaged_checkpoint,
         untouched=("results/**/*",)),
    Case("cancel of a recycled pid", "cancel a pid given to another process",
         ("cancel", "L", "--results-dir", "{d}/results", "--timeout", "1"),
         "its pid {pid} now belongs to another process, which is left alone", refuse=False, setup=_reused_pid,
         check=lambda d, result: "kill" not in result.stdout, untouched=("results/L/launch.json",)),
    *(Case("an S3 URI no command holds", f"script_s3_uri {says[:24]}",
           (*cases57.CLUSTER, f"node_setup.script_s3_uri={uri}", "-o", "{d}/out"), says)
      for uri, says in cases57.S3_URIS),
    Case("an S3 URI no command holds", "values printed into commands are quoted",
         (*cases57.CLUSTER, "node_setup.script_s3_uri='s3://b/nxdt/on_node(1).sh'", "-o", "{d}/my out"), "next:",
         refuse=False, check=_each_value_one_word),
    Case("logs after a stage-only launch", "logs RUN training after stages=[conversion]",
         ("logs", "gpt3_tiny", "training", "--results-dir", "{d}/results"), "training of the launch of 2026-01-01",
         refuse=False, setup=_two_launches, untouched=("results/**/*",)),
    Case("dry runs of a live run", "a dry run removes an earlier dry run's directory", DRY,
         "this dry run wrote its files under", refuse=False, setup=_live_run_with_an_old_dry_run,
         check=_one_dry_run_directory, untouched=("results/gpt3_tiny/launch.json",)),
    # Launches pointed into another run's directories (test_ownership_57.py has each case at length).
    Case("a launch into another run's directories", "training into a finished run's checkpoints",
         _training_of_run("L3", "training.exp_manager.checkpoint_callback_params.dirpath={ckpt}"),
         "belongs to run L", setup=_finished_run, untouched=("results/L/**/*",)),
    Case("a launch into another run's directories", "save_top_k=1 into a finished run's checkpoints",
         _training_of_run("L3", "training.exp_manager.checkpoint_callback_params.dirpath={ckpt}",
                          "training.exp_manager.checkpoint_callback_params.save_top_k=1"),
         "belongs to run L", setup=_finished_run, untouched=("results/L/**/*",)),
    Case("a launch into another run's directories", "an import into a finished run's checkpoints",
         ("stages=[conversion]", "cluster_type=local", "base_results_dir={d}/results", "run_name=L4",
          "conversion.mode=import", "conversion.checkpoint_dir={ckpt}", "conversion.hf_checkpoint_dir={d}/hf"),
         "belongs to run L", setup=_finished_run, untouched=("results/L/**/*",)),
    Case("a launch into another run's directories", "an export overwriting the run directory it exports",
         ("stages=[conversion]", "cluster_type=local", "base_results_dir={d}/results", "run_name=L",
          "conversion.output_dir={run}", "conversion.overwrite=true"),
         "which overwrite would delete", setup=_finished_run, untouched=("results/L/**/*",)),
    # What a hostile sweep must still accept.
    Case("a plain launch", "a dry run of the tiny recipe", DRY, "training", refuse=False),
    Case("a plain launch", "explain-config of a small file", ("explain-config", "configs/small.yaml"),
         "model.num_layers", refuse=False, setup=files(**{"configs/small.yaml": "model:\n  num_layers: 2\n"})),
]

# Node-side cases: the stage's own program on a damaged input, run by these tests (test file, test function).
COVERED_ELSEWHERE = {
    "a loss that turns NaN": ("tests/runtime_train/test_bad_training_input.py",
                              "test_a_loss_that_stops_being_finite_is_one_line_from_rank_0"),
    "a token id beyond the vocabulary": ("tests/runtime_train/test_bad_training_input.py",
                                         "test_a_token_id_beyond_the_vocabulary_names_the_file_and_position"),
    "a full disk in data preparation": ("tests/data_prep/test_full_disk.py",
                                        "test_a_full_disk_is_one_line_and_leaves_no_temporary_file"),
    "a full disk in export and import": ("tests/convert/test_full_disk.py",
                                         "test_a_full_disk_is_one_line_and_leaves_nothing_half_written"),
    "a checkpoint config.yaml that is not YAML, on the node": (
        "tests/launcher/test_hostile_input_57.py", "test_a_checkpoint_config_that_is_not_yaml_is_one_line_on_the_node"),
    "HF weights that are not float, or NaN/inf": (
        "tests/convert/test_weight_values.py", "test_values_that_are_not_weights_are_refused_naming_tensor_and_file"),
    "NaN weights on the node": ("tests/convert/test_weight_values.py",
                                "test_the_conversion_stage_on_the_node_refuses_nan_weights"),
    "a pytorch_model.bin holding a non-tensor pickle": ("tests/convert/test_weight_values.py",
                                                        "test_a_pytorch_bin_pickling_other_objects_is_one_line"),
    "an unexpected tensor in fine-tuning": ("tests/convert/test_weight_values.py",
                                            "test_an_unexpected_tensor_is_refused_by_fine_tuning_as_by_import"),
    "DPO whose chosen equals rejected": ("tests/alignment/test_identical_pairs.py",
                                         "test_identical_pairs_are_refused_naming_the_file_and_the_count"),
}


def _snapshot(d: Path, globs: tuple[str, ...]) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for pattern in globs for p in d.glob(pattern) if p.is_file()}


def classify(case: Case, d: Path, data: Path) -> tuple[str, str]:
    """(the outcome's class, what was seen) of one case run in the fresh directory `d`."""
    d.mkdir(parents=True, exist_ok=True)
    with (case.setup(d, data) if case.setup else contextlib.nullcontext({})) as values:
        fmt = {"d": d, "data": data, **values}
        argv = case.argv(fmt) if callable(case.argv) else [arg.format(**fmt) for arg in case.argv]
        before = _snapshot(d, case.untouched)
        try:
            result = nxdt(*argv, cwd=d, timeout=case.timeout)
        except subprocess.TimeoutExpired:
            return "hang", f"still running after {case.timeout:g} s"
        after = _snapshot(d, case.untouched)
        says = case.says.format(**fmt)
        seen = (result.stderr.strip() or result.stdout.strip())[-300:]
        if "Traceback (most recent call last)" in result.stdout + result.stderr:
            return "traceback", seen
        if changed := sorted(name for name in before if before[name] != after.get(name)):
            return "data loss", f"changed or removed: {', '.join(changed[:5])}"
        if result.returncode == 0:
            if case.refuse:
                return "silent acceptance", seen
            done = says in result.stdout and (case.check is None or case.check(d, result))
            return ("correct acceptance", "") if done else ("silent acceptance", seen)
        lines = result.stderr.strip().splitlines()
        if case.refuse and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0]:
            return "clean refusal", ""
        return "unclear refusal", f"exit {result.returncode}: {seen}"


OUTCOMES: dict[str, tuple[str, str]] = {}


def _run(case: Case, tmp_path_factory, data: Path) -> tuple[str, str]:
    key = f"{case.kind}: {case.name}"
    if key not in OUTCOMES:
        OUTCOMES[key] = classify(case, tmp_path_factory.mktemp("case"), data)
    return OUTCOMES[key]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}: {c.name}"[:70] for c in CASES])
def test_each_case(case, tmp_path_factory, recipe_data_dir):
    outcome, seen = _run(case, tmp_path_factory, recipe_data_dir)
    assert outcome == ("clean refusal" if case.refuse else "correct acceptance"), f"{outcome}: {seen}"


def test_the_counter(tmp_path_factory, recipe_data_dir):
    """Tracebacks 0, silent acceptances 0, hangs 0, data loss 0 (and no unclear refusal) over the whole table."""
    found = Counter(_run(case, tmp_path_factory, recipe_data_dir)[0] for case in CASES)
    table = ", ".join(f"{n} {outcome}" for outcome, n in found.most_common())
    print(f"{len(CASES)} cases: {table}; {len(COVERED_ELSEWHERE)} node-side kinds covered elsewhere")
    assert set(found) <= set(OK), table
    assert found["clean refusal"] == sum(c.refuse for c in CASES), table


def test_the_list_of_cases_covered_elsewhere_is_true():
    for kind, (path, name) in COVERED_ELSEWHERE.items():
        tree = ast.parse((REPO / path).read_text())
        assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, f"{kind}: {path}::{name}"


def test_the_classifier_counts_each_kind_of_failure(tmp_path, recipe_data_dir):
    """The counter can fail: an acceptance where a refusal is due is silent, a refusal without the case's words is
    unclear, a changed file listed as untouched is data loss, a case past its timeout is a hang."""
    assert classify(Case("k", "n", DRY, "nothing"), tmp_path / "a", recipe_data_dir)[0] == "silent acceptance"
    assert classify(Case("k", "n", ("training.model.seed=-1", *DRY), "other words"), tmp_path / "b",
                    recipe_data_dir)[0] == "unclear refusal"
    # A file the case says must not change, which a dry run into that directory rewrites.
    loses = Case("k", "n", ("training.run.results_dir={d}/mine", *DRY), "", refuse=False,
                 setup=files(**{"mine/training_config.yaml": "mine\n"}), untouched=("mine/*",))
    assert classify(loses, tmp_path / "d", recipe_data_dir)[0] == "data loss"
    assert classify(Case("k", "n", ("explain-config", "configs/bomb.yaml"), BOMB, timeout=0.01,
                         setup=files(**{"configs/bomb.yaml": cases57._bomb()})), tmp_path / "e",
                    recipe_data_dir)[0] == "hang"
