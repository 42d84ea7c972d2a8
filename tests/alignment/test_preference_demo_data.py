"""The synthetic preference set: reproducible bytes, disjoint splits, right chosen and wrong rejected answers
(both recomputed here from the prompts, not with the generator's code), rows that fit without truncation, and
the data_preparation stage that writes it (input.source synthetic_preferences, conf preference_demo)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.alignment.data import build_preference_dataset
from runtime.alignment.synthetic import CORRUPTIONS, main, make_splits, task_of, write_demo

REPO = Path(__file__).resolve().parents[2]
SMALL = {"num_train": 300, "num_valid": 30, "num_test": 30, "seed": 5, "vocab_size": 400}
FILES = ("train.jsonl", "valid.jsonl", "test.jsonl", "tokenizer.json", "tokenizer_config.json", "summary.json")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert write_demo(out, **SMALL) is True
    return out


def _records(out, split):
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


def _expected(prompt: str) -> tuple[str, set[str]]:
    """Each task's right answer and its possible wrong answers, worked out from the prompt text alone."""
    head, _, body = prompt.partition(": ")
    items = body.split(" ")
    if head == "reverse":
        return " ".join(items[::-1]), {body[::-1]}
    if head == "sort":
        right = " ".join(sorted(items, key=int))
        return right, {body} if body != right else {" ".join(sorted(items, key=int, reverse=True))}
    if head == "add":
        a, plus, b = items
        assert plus == "+"
        return str(int(a) + int(b)), {a + b}
    if head == "upper":
        return body.upper(), {body}
    if head == "format":
        name, age, color = items
        return ('{"name": "%s", "age": %s, "color": "%s"}' % (name, int(age), color),
                {'{"name": "%s", "age": "%s", "color": "%s"}' % (name, int(age), color)})
    raise AssertionError(f"unknown task in prompt {prompt!r}")


def test_same_seed_same_bytes_other_seed_other_data(demo, tmp_path):
    again = tmp_path / "again"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    subprocess.run([sys.executable, "-m", "runtime.alignment.synthetic", "--output-dir", str(again), *args],
                   check=True, cwd=REPO, capture_output=True)
    for name in FILES:
        assert (again / name).read_bytes() == (demo / name).read_bytes(), name
    other = make_splits(SMALL["num_train"], SMALL["num_valid"], SMALL["num_test"], seed=6)
    assert other["train"] != _records(demo, "train")


def test_splits_are_disjoint_balanced_and_test_is_drawn_first(demo):
    prompts = {split: [r["prompt"] for r in _records(demo, split)] for split in ("train", "valid", "test")}
    for split, items in prompts.items():
        assert len(items) == len(set(items)) == SMALL[f"num_{split}"]
    assert not set(prompts["test"]) & (set(prompts["train"]) | set(prompts["valid"]))
    assert not set(prompts["train"]) & set(prompts["valid"])
    summary = json.loads((demo / "summary.json").read_text())
    assert summary["counts"]["train"] == {task: 60 for task in CORRUPTIONS}
    assert make_splits(50, 10, 20, seed=3)["test"] == make_splits(500, 10, 20, seed=3)["test"]


def test_chosen_is_right_and_rejected_is_the_tasks_mistake(demo):
    for split in ("train", "valid", "test"):
        for record in _records(demo, split):
            assert sorted(record) == ["chosen", "prompt", "rejected"]
            right, wrong = _expected(record["prompt"])
            assert record["chosen"] == right and record["rejected"] in wrong and right not in wrong, record


def test_at_the_default_size_pairs_fit_a_128_token_row_and_length_does_not_tell(tmp_path):
    from tokenizers import Tokenizer

    write_demo(tmp_path)  # under a second
    dataset = build_preference_dataset([tmp_path / "train.jsonl"], tmp_path, 128, max_prompt_length=64)
    assert dataset.stats["kept"] == 20000 and dataset.stats["truncated"] == 0
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lengths = [[len(e.ids) for e in tokenizer.encode_batch([r["chosen"], r["rejected"]])]
               for r in _records(tmp_path, "test")]
    # Response length alone must not tell chosen from rejected: within two tokens, either way round.
    assert all(abs(chosen - rejected) <= 2 for chosen, rejected in lengths)
    assert {chosen < rejected for chosen, rejected in lengths} == {True, False}


def test_rerun_is_a_no_op_and_an_interrupted_run_is_redone(demo, capsys):
    before = {name: (demo / name).stat().st_mtime_ns for name in FILES}
    assert write_demo(demo, **SMALL) is False
    assert main(["--output-dir", str(demo), *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]]) == 0
    assert "already written" in capsys.readouterr().out
    assert {name: (demo / name).stat().st_mtime_ns for name in FILES} == before
    (demo / "summary.json").unlink()  # written last: without it the directory counts as unfinished
    assert write_demo(demo, **SMALL) is True


@pytest.mark.parametrize("key, value, words", [
    ("num_test", 0, "num_test=0 must be a positive integer"),
    ("vocab_size", 100, "vocab_size=100 is below 300"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, key, value, words):
    with pytest.raises(ValueError, match=words) as err:
        write_demo(tmp_path, **{**SMALL, key: value})
    assert "\n" not in str(err.value) and not list(tmp_path.iterdir())
    assert main(["--output-dir", str(tmp_path), f"--{key.replace('_', '-')}={value}"]) == 2
    assert words in capsys.readouterr().err


# The data stage: conf/data_preparation/preference_demo.yaml, composed as the launcher composes it.
def _stage(tmp_path) -> dict:
    from launcher.compose import compose, resolve

    return resolve(compose([f"data_dir={tmp_path}", "data_preparation=preference_demo"]))["data_preparation"]


def test_preference_demo_is_one_task_that_writes_the_pairs(tmp_path):
    from runtime.data_prep.plan import check_inputs, count_tasks
    from runtime.data_prep.run import run_task
    from runtime.schema.data_preparation import parse_config

    stage = _stage(tmp_path)
    assert stage["synthetic_preferences"] == {"num_train": 4000, "num_valid": 256, "num_test": 512,
                                              "seed": 1234, "vocab_size": 512}
    stage["synthetic_preferences"].update(num_train=60, num_valid=10, num_test=10)
    assert count_tasks(stage) == 1 and check_inputs(stage) == []
    cfg = parse_config(stage)
    assert cfg.tokenizer.model is None and cfg.synthetic_preferences.num_train == 60
    assert run_task(cfg, 1, 2) is False  # task 0 writes it alone
    assert run_task(cfg, 0, 1) is True
    out = tmp_path / "preference_demo"
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert len(_records(out, "train")) == 60 and {task_of(r) for r in _records(out, "train")} == set(CORRUPTIONS)
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run_task(cfg, 0, 1) is True  # already complete: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written


@pytest.mark.parametrize("change, message", [
    ({"synthetic_preferences": {"vocab_size": 100}},
     "data_preparation.synthetic_preferences.vocab_size: 100 must be an integer >= 300"),
    ({"synthetic_preferences": {"num_test": 0}},
     "data_preparation.synthetic_preferences.num_test: 0 must be a positive integer"),
    ({"synthetic_preferences": {"num_tests": 5}}, "data_preparation.synthetic_preferences.num_tests: unknown key"),
    ({"tokenizer": {"model": "tok.json"}},
     "data_preparation.tokenizer.model: input.source 'synthetic_preferences' writes its own tokenizer"),
])
def test_bad_settings_name_the_key(tmp_path, change, message):
    from runtime.schema.data_preparation import UserError, parse_config

    stage = _stage(tmp_path)
    for section, values in change.items():
        stage.setdefault(section, {}).update(values)
    with pytest.raises(UserError) as error:
        parse_config(stage)
    assert any(message in problem for problem in error.value.problems), error.value.problems
