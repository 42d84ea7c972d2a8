"""The built-in next-line task: deterministic, well-formed, at chance for a blind model, learnable."""
import json
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import torch

from runtime.data_prep.demo import documents
from runtime.evaluate.synthetic import build_demo_task
from runtime.evaluate.tasks import load_task
from tests.evaluate.standin import score
from tests.evaluate.test_tasks import lookup

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NUM_EXAMPLES = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[str]]:
    """Two stdlib modules as demo-corpus JSON lines (as runtime/data_prep/demo.py writes them), and the texts."""
    texts = [doc for name in ("textwrap.py", "shlex.py") for doc in documents(STDLIB / name)]
    path = tmp_path_factory.mktemp("corpus") / "demo.jsonl"
    path.write_text("".join(json.dumps({"text": text, "source": "stdlib"}) + "\n" for text in texts))
    return str(path), texts


@pytest.fixture(scope="module")
def task_path(corpus, tmp_path_factory) -> str:
    return build_demo_task([corpus[0]], str(tmp_path_factory.mktemp("task") / "next_line.jsonl"), NUM_EXAMPLES)


def test_same_inputs_give_the_same_bytes(corpus, task_path, tmp_path):
    again = build_demo_task([corpus[0]], str(tmp_path / "again.jsonl"), NUM_EXAMPLES)
    assert Path(again).read_bytes() == Path(task_path).read_bytes()
    other_seed = build_demo_task([corpus[0]], str(tmp_path / "seed1.jsonl"), NUM_EXAMPLES, seed=1)
    assert Path(other_seed).read_bytes() != Path(task_path).read_bytes()


def test_items_are_valid_next_lines_with_three_reordered_distractors(corpus, task_path):
    records = [json.loads(line) for line in Path(task_path).read_text().splitlines()]
    assert len(records) == NUM_EXAMPLES
    joined = "\n".join(corpus[1])
    for record in records:
        choices, gold = record["choices"], record["gold"]
        assert len(choices) == 4 and len(set(choices)) == 4 and 0 <= gold < 4
        assert record["context"].endswith("\n")
        assert record["context"] + choices[gold] + "\n" in joined  # the true line follows its context
        assert all(sorted(choice) == sorted(choices[gold]) for choice in choices)  # same characters
    # Gold positions are uniform, so a model that cannot tell the choices apart scores 25%.
    positions = Counter(record["gold"] for record in records)
    assert all(0.15 * NUM_EXAMPLES < positions[i] < 0.35 * NUM_EXAMPLES for i in range(4))
    assert load_task({"name": "next_line", "type": "multiple_choice", "path": task_path}).name == "next_line"


def test_a_model_of_the_corpus_character_pairs_beats_chance(corpus, task_path, tmp_path):
    # A character bigram model fitted on the corpus stands in for a briefly trained model.
    ids = torch.tensor([min(ord(c), 127) for c in "".join(corpus[1])])
    counts = torch.ones(128, 128).index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1), accumulate=True)
    table = torch.log(counts / counts.sum(-1, keepdim=True))

    def forward_logprobs(input_ids, targets):
        return lookup(table, input_ids, targets)

    task = load_task({"name": "next_line", "type": "multiple_choice", "path": task_path})
    result = score(task, forward_logprobs, tmp_path, max_length=512, batch_size=32)  # through lm-eval
    assert result["acc"] > 0.35
    assert result["acc_norm"] == result["acc"]  # all choices have the same length


def test_too_small_a_corpus_is_a_value_error(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": "def f(x):\n    y = x + 1\n    return y * 2\n"}) + "\n")
    with pytest.raises(ValueError, match="num_examples=5 but the corpus .* has only 1 usable lines"):
        build_demo_task([str(path)], str(tmp_path / "out.jsonl"), num_examples=5)
