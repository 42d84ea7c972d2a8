"""The synthetic SFT set: reproducible bytes, disjoint splits, right answers (recomputed here from the prompts,
not with the generator's own code), a tokenizer that round-trips ChatML, and one-line errors."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.sft import synthetic
from runtime.sft.synthetic import CHAT_TEMPLATE, SPECIAL_TOKENS, main, make_splits, write_demo
from tests.sft.chatml import render_chatml

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


def _expected(prompt: str) -> str:
    """Each task's answer, worked out from the prompt text alone."""
    head, _, body = prompt.partition(": ")
    items = body.split(" ")
    if head == "reverse":
        return " ".join(items[::-1])
    if head == "sort":
        return " ".join(str(n) for n in sorted(int(i) for i in items))
    if head == "add":
        a, plus, b = items
        assert plus == "+"
        return str(int(a) + int(b))
    if head == "upper":
        return " ".join(item.upper() for item in items)
    if head == "format":
        name, age, color = items
        return '{"name": "%s", "age": %s, "color": "%s"}' % (name, int(age), color)
    raise AssertionError(f"unknown task in prompt {prompt!r}")


def test_same_seed_same_bytes_other_seed_other_data(demo, tmp_path):
    # Another process too (python -m), since a tokenizer trainer could depend on per-process hash seeds.
    again = tmp_path / "again"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    subprocess.run([sys.executable, "-m", "runtime.sft.synthetic", "--output-dir", str(again), *args],
                   check=True, cwd=REPO, capture_output=True)
    for name in FILES:
        assert (again / name).read_bytes() == (demo / name).read_bytes(), name
    other = tmp_path / "other"
    write_demo(other, **{**SMALL, "seed": 6})
    assert (other / "train.jsonl").read_bytes() != (demo / "train.jsonl").read_bytes()


def test_splits_are_disjoint_sized_and_balanced(demo):
    prompts = {split: [r["messages"][0]["content"] for r in _records(demo, split)]
               for split in ("train", "valid", "test")}
    for split, items in prompts.items():
        assert len(items) == SMALL[f"num_{split}"]
        assert len(set(items)) == len(items), f"{split} repeats a prompt"
    assert not set(prompts["train"]) & set(prompts["test"])
    assert not set(prompts["train"]) & set(prompts["valid"])
    assert not set(prompts["valid"]) & set(prompts["test"])
    summary = json.loads((demo / "summary.json").read_text())
    assert summary["tasks"] == list(synthetic.TASKS)
    assert summary["counts"]["train"] == {task: 60 for task in synthetic.TASKS}
    assert {k: summary[k] for k in SMALL} == SMALL


def test_test_split_does_not_depend_on_train_size():
    # Drawn first, so a longer training run is still scored on the same held-out prompts.
    small = make_splits(50, 10, 20, seed=3)
    large = make_splits(500, 10, 20, seed=3)
    assert small["test"] == large["test"] and small["valid"] == large["valid"]


def test_answers_are_right_and_short(demo):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    for split in ("train", "valid", "test"):
        for record in _records(demo, split):
            user, assistant = record["messages"]
            assert (user["role"], assistant["role"]) == ("user", "assistant")
            assert assistant["content"] == _expected(user["content"]), user["content"]
            # Short enough that several pack into one 128-token row (<= 36 with the default 512-token BPE;
            # this small one has fewer merges).
            assert len(tokenizer.encode(render_chatml(record["messages"])).ids) <= 48, record


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(demo):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token).ids == [tokenizer.token_to_id(token)]
    for split in ("train", "test"):
        for record in _records(demo, split):
            text = render_chatml(record["messages"])
            ids = tokenizer.encode(text).ids
            assert tokenizer.decode(ids, skip_special_tokens=False) == text
            # The prompt a generator is given tokenizes to a prefix of the whole conversation.
            prompt = tokenizer.encode(render_chatml(record["messages"][:1], add_generation_prompt=True)).ids
            assert ids[:len(prompt)] == prompt
    # Numbers are spelled digit by digit; role names are single tokens.
    assert tokenizer.encode("1234 56").tokens == ["1", "2", "3", "4", "\u01205", "6"]
    assert len(tokenizer.encode("assistant").ids) == 1 and len(tokenizer.encode("user").ids) == 1


def test_tokenizer_config_is_chatml_ending_at_im_end(demo):
    config = json.loads((demo / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|im_end|>", "<|pad|>", None)
    assert {v["content"] for v in config["added_tokens_decoder"].values()} == set(SPECIAL_TOKENS)
    messages = [{"role": "user", "content": "add: 12 + 34"}, {"role": "assistant", "content": "46"}]
    assert render_chatml(messages) == "<|im_start|>user\nadd: 12 + 34<|im_end|>\n<|im_start|>assistant\n46<|im_end|>\n"
    assert render_chatml(messages[:1], add_generation_prompt=True) == \
        "<|im_start|>user\nadd: 12 + 34<|im_end|>\n<|im_start|>assistant\n"


def test_rerun_is_a_no_op_and_an_interrupted_run_is_redone(demo, capsys):
    before = {name: (demo / name).stat().st_mtime_ns for name in FILES}
    assert write_demo(demo, **SMALL) is False
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert main(["--output-dir", str(demo), *args]) == 0
    assert "already written" in capsys.readouterr().out
    assert {name: (demo / name).stat().st_mtime_ns for name in FILES} == before
    # summary.json is written last: without it the directory counts as unfinished.
    (demo / "summary.json").unlink()
    assert write_demo(demo, **SMALL) is True
    assert not [p.name for p in demo.iterdir() if ".tmp-" in p.name]


def test_other_arguments_rewrite(tmp_path):
    write_demo(tmp_path, **SMALL)
    assert write_demo(tmp_path, **{**SMALL, "num_test": 40}) is True
    assert len(_records(tmp_path, "test")) == 40


@pytest.mark.parametrize("key, value, words", [
    ("num_test", 0, "num_test=0 must be a positive integer"),
    ("num_train", -5, "num_train=-5 must be a positive integer"),
    ("vocab_size", 100, "vocab_size=100 is below 300"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, key, value, words):
    with pytest.raises(ValueError, match=words) as err:
        write_demo(tmp_path, **{**SMALL, key: value})
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())
    assert main(["--output-dir", str(tmp_path), f"--{key.replace('_', '-')}={value}"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and words in err_lines[0]


def test_asking_for_more_than_a_task_holds_names_the_task(monkeypatch):
    def coin(rng: random.Random) -> tuple[str, str]:
        side = rng.choice(["heads", "tails"])
        return f"flip: {side}", side

    monkeypatch.setattr(synthetic, "TASKS", {"flip": coin})
    with pytest.raises(ValueError, match=r"more than the 'flip' task has distinct prompts.*ask for fewer"):
        make_splits(1, 1, 1, seed=0)
