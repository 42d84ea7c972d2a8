"""The render-time half: config parsing, file_numbers, shard lists, count_tasks and check_inputs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.schema.data_preparation import UserError, parse_config
from runtime.data_prep.plan import build_shards, check_inputs, count_tasks, parse_file_numbers, shards_for_task
from tests.data_prep.conftest import REPO, stage, write_jsonl


@pytest.mark.parametrize("spec, expected", [
    ("0", [0]), ("0-29", list(range(30))), ("0,3,5-7", [0, 3, 5, 6, 7]), (" 2 , 4 - 5 ", [2, 4, 5]),
    (7, [7]), ("9,1", [9, 1]),
])
def test_file_numbers(spec, expected):
    assert parse_file_numbers(spec) == expected


@pytest.mark.parametrize("spec, words", [
    ("", "is not a number"), ("a", "'a' is not a number"), ("5-3", "runs backwards; write 3-5"),
    ("1,1", "1 appears twice"), ("1-3,2", "2 appears twice"), ("-1", "is not a number"), ("1-", "not a number"),
    # bounded before the list is built (the override fuzz once grew the launcher to 24 GB on a number like these)
    ("0-99999999999999999999", "names more than 100000 files"), ("0-50000,60000-120000", "more than 100000"),
])
def test_bad_file_numbers(spec, words):
    with pytest.raises(UserError, match=words):
        parse_file_numbers(spec)


def test_shards_from_globs_patterns_and_numbers(tmp_path):
    for name in ("b", "a", "c", "d"):
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", ["x"])
    cfg = parse_config(stage(tmp_path, tokenizer={"model": "t.json"}))
    assert [s.name for s in build_shards(cfg)] == ["a", "b", "c", "d"]
    picked = parse_config(stage(tmp_path, tokenizer={"model": "t.json"}, input={"file_numbers": "3,0-1"}))
    assert [s.name for s in build_shards(picked)] == ["d", "a", "b"]
    for n in range(3):
        write_jsonl(tmp_path / "num" / f"{n:02d}.jsonl.gz", [])
    pattern = str(tmp_path / "num" / "{:02d}.jsonl.gz")
    numbered = parse_config(stage(tmp_path, tokenizer={"model": "t.json"},
                                  input={"files": [pattern], "file_numbers": "2,0"}))
    shards = build_shards(numbered)
    assert [s.name for s in shards] == ["02", "00"]
    assert [s.name for s in shards_for_task(build_shards(cfg), 1, 2)] == ["b", "d"]


def test_same_file_names_get_numbered(tmp_path):
    write_jsonl(tmp_path / "in" / "x" / "train.jsonl", ["a"])
    write_jsonl(tmp_path / "in" / "y" / "train.jsonl", ["b"])
    cfg = parse_config(stage(tmp_path, tokenizer={"model": "t.json"},
                             input={"files": [str(tmp_path / "in" / "**" / "*.jsonl")]}))
    assert [s.name for s in build_shards(cfg)] == ["00000_train", "00001_train"]


def test_count_tasks(tmp_path):
    for n in range(5):
        write_jsonl(tmp_path / "in" / f"{n}.jsonl", ["x"])
    assert count_tasks(stage(tmp_path, tokenizer={"model": "t.json"})) == 5
    assert count_tasks(stage(tmp_path, tokenizer={"model": "t.json"}, max_array_tasks=2)) == 2
    assert count_tasks(stage(tmp_path, tokenizer={"train": {"vocab_size": 300}},
                             input={"source": "demo"}, demo={"num_shards": 3})) == 3
    urls = {"source": "urls", "urls": "https://example.com/train/{:02d}.jsonl.zst", "file_numbers": "0-29"}
    assert count_tasks(stage(tmp_path, tokenizer={"model": "t.json"}, input=urls,
                             download={"dir": str(tmp_path)})) == 30


def test_check_inputs_reports_every_missing_input(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", ["x"])
    cfg = stage(tmp_path, input={"files": [str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "nope.jsonl"),
                                           str(tmp_path / "none" / "*.jsonl"), str(tmp_path / "in" / "a.txt")]},
                tokenizer={"vocab_file": str(tmp_path / "vocab.json"), "merge_file": "https://h/merges.txt"})
    (tmp_path / "in" / "a.txt").write_text("x")
    errors = check_inputs(cfg)
    assert any("nope.jsonl': no such file" in e for e in errors), errors
    assert any("*.jsonl': the pattern matches no file" in e for e in errors), errors
    assert any("a.txt': unsupported file type" in e for e in errors), errors
    assert any(e.startswith("tokenizer.vocab_file = ") and "no such file" in e for e in errors), errors
    assert not any("merges.txt" in e for e in errors), "URLs must not be fetched or checked at render time"
    assert all("\n" not in e for e in errors)


def test_check_inputs_passes_and_checks_weights(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "a.jsonl", ["x"])
    write_jsonl(tmp_path / "in" / "b.jsonl", ["x"])
    assert check_inputs(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)})) == []
    errors = check_inputs(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)},
                                output={"blend_weights": {"a": 1.0, "c": 2}}))
    assert any("output.blend_weights.c: no shard has that name" in e for e in errors), errors
    assert any("no weight for shard 'b'" in e for e in errors), errors


@pytest.mark.parametrize("section, message", [
    ({"input": {"source": "file"}}, "data_preparation.input.source: 'file' is not one of demo, files, urls, synthetic_instructions, synthetic_preferences, synthetic_prompts; did you mean 'files'?"),
    ({"input": {"file_numbers": "0-x"}}, "input.file_numbers = '0-x': '0-x' is not a number"),
    ({"input": {"on_bad_line": "ignore"}}, "data_preparation.input.on_bad_line: 'ignore' is not one of skip, fail"),
    ({"input": {"on_long_record": "drop"}}, "data_preparation.input.on_long_record: 'drop' is not one of skip, fail"),
    ({"input": {"max_record_mb": 0}}, "data_preparation.input.max_record_mb: 0.0 must be > 0 and at most 2147 (a "
     "document's token count is an int32 in the .idx); longer records are skipped and counted, or fail the task "
     "with input.on_long_record: fail"),
    ({"input": {"max_record_mb": 4096}}, "data_preparation.input.max_record_mb: 4096.0 must be > 0 and at most 2147"),
    ({"input": {"max_record_mb": "big"}}, "data_preparation.input.max_record_mb: 'big' is not a number"),
    ({"workers_per_node": 0}, "data_preparation.workers_per_node: 0 must be a positive integer"),
    ({"input": {"source": "demo"}, "demo": {"num_shards": 2**31}},
     "data_preparation.demo.num_shards: 2147483648 must be at most 64 (the demo corpus is a few hundred files"),
    ({"tokenizer": {"library": "spm", "model": "x"}}, "data_preparation.tokenizer.library: 'spm' is not one of huggingface, sentencepiece"),
    ({"tokenizer": {}}, "tokenizer: set one of model"),
    ({"tokenizer": {"model": "a", "train": {"vocab_size": 5}}}, "model and train are both set"),
    ({"tokenizer": {"vocab_file": "v.json"}}, "tokenizer.vocab_file and data_preparation.tokenizer.merge_file go together"),
    ({"tokenizer": {"train": {"vocab_size": 500, "model_type": "wordpiece"}}}, "data_preparation.tokenizer.train.model_type: 'wordpiece' with library 'huggingface' must be one of"),
    ({"tokenizer": {"train": {"vocab_size": 500, "vocab": 3}}}, "tokenizer.train.vocab: unknown key"),
    ({"output": {"dtype": "float32"}}, "data_preparation.output.dtype: 'float32' is not one of auto"),
    ({"outputs": {}}, "data_preparation.outputs: unknown key; did you mean 'output'? valid keys here: "),
    ({"input": {"source": "urls", "urls": ["https://x/a.jsonl"]}}, "data_preparation.download.dir: missing"),
])
def test_config_mistakes_are_one_line(tmp_path, section, message):
    write_jsonl(tmp_path / "in" / "a.jsonl", ["x"])
    (tmp_path / "t.json").write_text("{}")
    cfg = stage(tmp_path, tokenizer={"model": str(tmp_path / "t.json")})
    for key, value in section.items():
        merge = isinstance(value, dict) and key in cfg and value and key != "tokenizer"
        cfg[key] = {**cfg[key], **value} if merge else value
    errors = check_inputs(cfg)
    assert len(errors) == 1 and message in errors[0], errors


def test_plan_imports_nothing_heavy():
    code = ("import sys, runtime.data_prep.plan as p; "
            "heavy = [m for m in ('numpy', 'tokenizers', 'sentencepiece', 'torch', 'yaml', 'rich') "
            "if m in sys.modules];"
            "print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_record_limit_is_one_line_at_launch_and_on_the_node(tmp_path):
    """The rule (runtime/schema/rules.py) gives the same line in the launcher's dry run and in the stage program
    that runs on the node, and nothing is written."""
    from launcher import launch
    from launcher.compose import compose, resolve
    from launcher.errors import UserError as LaunchError
    from tests.data_prep.conftest import run_cli

    overrides = ["stages=[data_preparation]", "cluster_type=local", f"base_results_dir={tmp_path / 'results'}",
                 f"data_dir={tmp_path / 'data'}", "data_preparation.input.max_record_mb=0"]
    line = ("data_preparation.input.max_record_mb: 0.0 must be > 0 and at most 2147 (a document's token count is "
            "an int32 in the .idx); longer records are skipped and counted, or fail the task with "
            "input.on_long_record: fail")
    with pytest.raises(LaunchError) as caught:
        launch.make_plan(overrides, dry_run=True, produced_by="test")
    assert line in caught.value.problems
    result = run_cli(resolve(compose(overrides))["data_preparation"], tmp_path)
    assert result.returncode == 2 and f"error: {line}" in result.stderr.splitlines(), result.stderr
    assert not (tmp_path / "results").exists() and not (tmp_path / "data").exists()
