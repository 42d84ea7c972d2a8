"""Zero-shot tasks read from local JSON-lines files: checked line by line before the model loads, then written
normalized for the lm-eval task files of runtime/evaluate/task_files, which lm-eval scores (runtime/evaluate/harness.py).

A task entry in the evaluation config:

    {name: lambada_local, type: last_word | multiple_choice | perplexity, path: /data/lambada.jsonl, limit: null}

`limit` keeps the first N examples (as lm-eval's --limit). Each line of the file is one JSON object:

last_word (lambada_openai): {"text": "..."}. Trailing whitespace is dropped; the target is the last
    space-separated word with its leading space (continuation = " " + word), the context everything before
    that space. Metrics (lm-eval's lambada): `acc` (the whole word is the greedy decode) and `perplexity`.

multiple_choice (hellaswag, piqa, winogrande, arc): the context under "context", "query" or "ctx"; the
    choices under "choices" (a list of strings); the answer index under "gold" or "label" (an int). Other
    keys are ignored. Continuation spacing: context and choice are joined with one space unless the context
    already ends with whitespace or the choice already starts with it (lm-eval's " " target delimiter, made
    safe for files whose choices carry their own separator, such as the next line of a program).
    Metrics: lm-eval's `acc` and `acc_norm` (log-likelihood over the choice's length in characters).

perplexity (wikitext): {"text": "..."}, each document scored whole (lm-eval's loglikelihood_rolling). Metrics:
    lm-eval's `word_perplexity`, `byte_perplexity`, `bits_per_byte`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.io.files import atomic_write_bytes

TASK_TYPES = ("last_word", "multiple_choice", "perplexity")
_SPEC_KEYS = ("name", "type", "path", "limit")
_CONTEXT_KEYS = ("context", "query", "ctx")
_GOLD_KEYS = ("gold", "label")


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # one of TASK_TYPES
    path: str
    limit: int | None = None


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]  # a last_word example has one: the target word with its leading space
    gold: int


def load_task(spec: Mapping[str, Any]) -> Task:
    """Validates one config task entry, and reads its file once so a bad line fails before the model loads."""
    label = f"tasks[{spec.get('name', '?')}]"
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"{label}: unknown key(s) {unknown}; valid keys: {list(_SPEC_KEYS)}")
    for key in ("name", "type", "path"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise ValueError(f"{label}.{key}: required, a non-empty string (got {spec.get(key)!r})")
    if spec["type"] not in TASK_TYPES:
        raise ValueError(f"{label}.type: {spec['type']!r} is not one of {list(TASK_TYPES)}")
    limit = spec.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{label}.limit: must be null or a positive integer, got {limit!r}")
    if not Path(spec["path"]).is_file():
        raise ValueError(f"{label}.path: no such file {spec['path']!r}")
    task = Task(name=spec["name"], kind=spec["type"], path=spec["path"], limit=limit)
    read_examples(task)
    return task


def read_examples(task: Task) -> list[Example]:
    parse = {"last_word": _parse_last_word, "multiple_choice": _parse_multiple_choice,
             "perplexity": _parse_text}[task.kind]
    examples = []
    with open(task.path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if task.limit is not None and len(examples) >= task.limit:
                break
            if not line.strip():
                continue
            where = f"{task.path}:{number}"
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
            if not isinstance(doc, dict):
                raise ValueError(f"{where}: not a JSON object")
            examples.append(parse(doc, where))
    if not examples:
        raise ValueError(f"tasks[{task.name}].path: {task.path!r} holds no examples")
    return examples


def _parse_last_word(doc: dict, where: str) -> Example:
    text = doc.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: key 'text' must be a string (got {text!r})")
    context, _, word = text.rstrip().rpartition(" ")
    if not context or not word:
        raise ValueError(f"{where}: key 'text' needs a context and a last word separated by a space")
    return Example(context=context, choices=(" " + word,), gold=0)


def _parse_text(doc: dict, where: str) -> Example:
    text = doc.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: key 'text' must be a non-empty string (got {text!r})")
    return Example(context="", choices=(text,), gold=0)


def _first_key(doc: dict, keys: tuple[str, ...], where: str) -> Any:
    for key in keys:
        if key in doc:
            return doc[key]
    raise ValueError(f"{where}: missing key {' / '.join(repr(k) for k in keys)}")


def _parse_multiple_choice(doc: dict, where: str) -> Example:
    context = _first_key(doc, _CONTEXT_KEYS, where)
    if not isinstance(context, str):
        raise ValueError(f"{where}: the context ({'/'.join(_CONTEXT_KEYS)}) must be a string")
    choices = _first_key(doc, ("choices",), where)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{where}: key 'choices' must be a non-empty list of non-empty strings")
    gold = _first_key(doc, _GOLD_KEYS, where)
    if isinstance(gold, bool) or not isinstance(gold, int):
        raise ValueError(f"{where}: key 'gold'/'label' must be an integer index (got {gold!r})")
    if not 0 <= gold < len(choices):
        raise ValueError(f"{where}: key 'gold'/'label' = {gold} is out of range for {len(choices)} choices")
    return Example(context=context, choices=tuple(choices), gold=gold)


def join_continuation(context: str, choice: str) -> str:
    """The continuation scored after `context`: the choice, with one separating space when neither has one."""
    if not context or context[-1].isspace() or choice[0].isspace():
        return choice
    return " " + choice


def mean_and_stderr(values: list[float]) -> tuple[float, float | None]:
    """Mean and lm-eval's stderr (sample standard deviation / sqrt(n); None when n < 2) of per-example scores."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def write_normalized(task: Task, path: str | Path) -> Path:
    """The task's examples as its lm-eval task file reads them (runtime/evaluate/task_files): multiple_choice
    {"context", "choices" (joined: each with its separator), "gold"}, last_word {"context", "target"}, perplexity
    {"text"}; written atomically, so a task never reads half a file."""
    lines = []
    for example in read_examples(task):
        if task.kind == "multiple_choice":
            doc = {"context": example.context, "gold": example.gold,
                   "choices": [join_continuation(example.context, choice) for choice in example.choices]}
        elif task.kind == "last_word":
            doc = {"context": example.context, "target": example.choices[0]}
        else:
            doc = {"text": example.choices[0]}
        lines.append(json.dumps(doc, ensure_ascii=False) + "\n")
    atomic_write_bytes(path, "".join(lines).encode())
    return Path(path)
