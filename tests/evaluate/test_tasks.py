"""Local task files, checked and normalized, scored by lm-eval through this repository's task files, against a
bigram "model" over characters whose scores are known.

The model: after each character one "favorite" character has logit FAVORITE_LOGIT and all others 0, so a
favorite costs F nats and any other character O nats (F > O), and the greedy decode is the favorite chain
' ' -> 'a' -> 'b' -> ' '. Every other character is followed by ' ' as favorite.
"""
import json
import math

import pytest
import torch

from runtime.evaluate.report import render_table, write_results
from runtime.evaluate.tasks import Task, join_continuation, load_task
from tests.evaluate.standin import score

VOCAB = 128
FAVORITE_LOGIT = 6.0
F = FAVORITE_LOGIT - math.log(math.exp(FAVORITE_LOGIT) + VOCAB - 1)  # log p(favorite)
O = -math.log(math.exp(FAVORITE_LOGIT) + VOCAB - 1)  # log p(any other character)


def favorite(char: str) -> str:
    return {" ": "a", "a": "b", "b": " "}.get(char, " ")


def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def forward_logprobs(input_ids, targets):  # targets (B, T) or (B, T, K): scoring.py's LogprobFn
    logits = torch.zeros(VOCAB, VOCAB)
    for previous in range(VOCAB):
        logits[previous, ord(favorite(chr(previous)))] = FAVORITE_LOGIT
    return lookup(torch.log_softmax(logits, dim=-1), input_ids, targets)


def lookup(table, input_ids, targets):
    """A bigram log-prob table's answer to a LogprobFn call."""
    rows = table[input_ids]  # (B, T, V)
    index = targets if targets.dim() == 3 else targets.unsqueeze(-1)
    logprobs, greedy = rows.gather(-1, index), rows.argmax(-1, keepdim=True) == index
    return (logprobs, greedy) if targets.dim() == 3 else (logprobs.squeeze(-1), greedy.squeeze(-1))


def write_jsonl(path, docs) -> str:
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs))
    return str(path)


@pytest.fixture
def evaluate(tmp_path):
    return lambda task: score(task, forward_logprobs, tmp_path)


MULTIPLE_CHOICE = [
    # " ab" = 3F beats " ba" = F + 2O, with or without normalization: right.
    {"context": "q", "choices": ["ab", "ba"], "gold": 0},
    # Same scores, gold on the worse choice: wrong both ways.
    {"query": "q", "choices": ["ab", "ba"], "label": 1},
    # " x" = F + O beats the 14F + O of the long choice in total, loses per character: only acc_norm right.
    {"ctx": "q", "choices": ["x", "ab ab ab ab ax"], "gold": 1},
    # " zz" = F + 2O against 3F, gold second: right both ways.
    {"context": "q", "choices": ["zz", "ab"], "gold": 1, "id": "extra keys are ignored"},
]


def test_multiple_choice_metrics_are_known_exactly(tmp_path, evaluate):
    assert F + O > 14 * F + O and (14 * F + O) / 14 > F + O  # the length-normalization example flips
    path = write_jsonl(tmp_path / "mc.jsonl", MULTIPLE_CHOICE)
    result = evaluate(load_task({"name": "mc", "type": "multiple_choice", "path": path, "limit": None}))
    assert result["task"] == "mc" and result["type"] == "lm_eval" and result["num_examples"] == 4
    assert result["acc"] == 0.5
    assert result["acc_stderr"] == pytest.approx(math.sqrt(1 / 12))  # sample std of [1, 0, 0, 1] / sqrt(4)
    assert result["acc_norm"] == 0.75
    assert result["acc_norm_stderr"] == pytest.approx(0.25)  # sample std of [1, 0, 1, 1] / sqrt(4)


def test_every_rank_of_a_node_gets_the_results(tmp_path, evaluate, monkeypatch):
    """torchrun gives each worker its LOCAL_RANK; lm-eval returns results only where it is 0, and each worker here
    runs lm-eval as the one process it sees."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    path = write_jsonl(tmp_path / "mc.jsonl", MULTIPLE_CHOICE)
    assert evaluate(load_task({"name": "mc", "type": "multiple_choice", "path": path}))["acc"] == 0.5
    import os

    assert os.environ["LOCAL_RANK"] == "1"  # given back


def test_limit_keeps_the_first_examples(tmp_path, evaluate):
    path = write_jsonl(tmp_path / "mc.jsonl", MULTIPLE_CHOICE)
    result = evaluate(load_task({"name": "mc", "type": "multiple_choice", "path": path, "limit": 1}))
    assert result["num_examples"] == 1 and result["acc"] == 1.0 and result["acc_stderr"] is None


def test_last_word_accuracy_and_perplexity(tmp_path, evaluate):
    texts = [
        "q ab",       # " ab": 3F, greedy
        "q ba",       # " ba": F + 2O
        "w x ab  ",   # trailing blanks dropped; context "w x", " ab": 3F, greedy
        "q abx",      # " abx": 3F + O
    ]
    path = write_jsonl(tmp_path / "lambada.jsonl", [{"text": t} for t in texts] + [""])
    result = evaluate(load_task({"name": "lambada_local", "type": "last_word", "path": path}))
    assert result["num_examples"] == 4
    assert result["acc"] == 0.5
    assert result["acc_stderr"] == pytest.approx(math.sqrt(1 / 12))
    assert result["perplexity"] == pytest.approx(math.exp(-(3 * F + (F + 2 * O) + 3 * F + (3 * F + O)) / 4), rel=1e-5)


def test_continuation_spacing_rule():
    assert join_continuation("Question: 2+2?", "4") == " 4"
    assert join_continuation("def f():\n", "    return 1") == "    return 1"  # context ends with whitespace
    assert join_continuation("The cat", " sat") == " sat"  # the choice brings its own space


@pytest.mark.parametrize("spec, lines, message", [
    ({"type": "last_word", "path": "/nonexistent/x.jsonl"}, None, r"tasks\[t\]\.path: no such file"),
    ({"type": "ranking"}, [], r"tasks\[t\]\.type: 'ranking' is not one of"),
    ({"type": "last_word", "limit": 0}, [], r"tasks\[t\]\.limit"),
    ({"type": "last_word", "shots": 5}, [], r"unknown key\(s\) \['shots'\]"),
    ({"type": "last_word"}, ['{"text": "a b"}', "{not json"], r"t\.jsonl:2: not a JSON object"),
    ({"type": "last_word"}, ['{"text": "oneword"}'], r"t\.jsonl:1: key 'text'"),
    ({"type": "multiple_choice"}, ['{"context": "c", "gold": 0}'], r"t\.jsonl:1: missing key 'choices'"),
    ({"type": "multiple_choice"}, ['{"choices": ["a"], "gold": 0}'], r"t\.jsonl:1: missing key 'context'"),
    ({"type": "multiple_choice"}, ['{"context": "c", "choices": ["a", "b"], "label": 2}'],
     r"t\.jsonl:1: key 'gold'/'label' = 2 is out of range for 2 choices"),
    ({"type": "multiple_choice"}, [], r"tasks\[t\]\.path: .* holds no examples"),
    ({"type": "perplexity"}, ['{"text": "  "}'], r"t\.jsonl:1: key 'text' must be a non-empty string"),
])
def test_bad_specs_and_files_raise_value_error_naming_the_key(tmp_path, spec, lines, message):
    if lines is not None:
        spec = {"path": write_jsonl(tmp_path / "t.jsonl", lines), **spec}
    with pytest.raises(ValueError, match=message):
        load_task({"name": "t", **spec})


def test_results_file_and_table(tmp_path, evaluate):
    path = write_jsonl(tmp_path / "mc.jsonl", MULTIPLE_CHOICE)
    result = evaluate(load_task({"name": "mc", "type": "multiple_choice", "path": path}))
    out = tmp_path / "out" / "results.json"
    write_results([result], out, checkpoint="/ckpt/step_50", step=50)
    saved = json.loads(out.read_text())
    assert saved == {"checkpoint": "/ckpt/step_50", "step": 50, "settings": None, "tasks": [result]}

    table = render_table([result])
    cells = [list(column.cells) for column in table.columns]
    rows = list(zip(*cells))
    assert rows == [("mc", "lm_eval", "4", "acc", "0.5000", "± 0.2887"),
                    ("", "", "", "acc_norm", "0.7500", "± 0.2500")]
