"""Zero-shot tasks read from local JSON-lines files, scored with lm-evaluation-harness's metric definitions.

A task entry in the evaluation config:

    {name: lambada_local, type: last_word | multiple_choice, path: /data/lambada.jsonl, limit: null}

`limit` keeps the first N examples (as lm-eval's --limit). Each line of the file is one JSON object:

last_word (lambada_openai): {"text": "..."}. Trailing whitespace is dropped; the target is the last
    space-separated word with its leading space (continuation = " " + word), the context everything before
    that space. Metrics: `acc` (the whole word is the greedy decode) and `ppl` = exp(-mean over examples of
    the word's summed log-likelihood), lm-eval's lambada perplexity.

multiple_choice (hellaswag, piqa, winogrande, arc): the context under "context", "query" or "ctx"; the
    choices under "choices" (a list of strings); the answer index under "gold" or "label" (an int). Other
    keys are ignored. Continuation spacing: context and choice are joined with one space unless the context
    already ends with whitespace or the choice already starts with it (lm-eval's " " target delimiter, made
    safe for files whose choices carry their own separator, such as the next line of a program).
    Metrics: `acc` = argmax of summed log-likelihood; `acc_norm` = argmax of summed log-likelihood divided
    by the choice's length in characters (the choice as written in the file, as lm-eval's acc_norm).
    Ties go to the lower index.

Both report `<metric>_stderr` for acc-style metrics: the sample standard deviation over examples / sqrt(n),
as lm-eval reports it (None when n < 2).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.evaluate.scoring import LogprobFn, loglikelihood

TASK_TYPES = ("last_word", "multiple_choice")
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
    parse = _parse_last_word if task.kind == "last_word" else _parse_multiple_choice
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


def encode_pair(tokenize: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Tokens of context and continuation, cut where the tokenizer would cut the joined text.

    As lm-eval does, trailing whitespace moves from the context to the continuation (BPE vocabularies attach
    whitespace to the following word), and the continuation's tokens are the tail of tokenize(whole) when
    tokenize(context) is its prefix; when a token straddles the seam, the continuation is encoded alone.
    """
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    context_tokens = tokenize(stripped)
    whole = tokenize(stripped + continuation)
    if len(whole) > len(context_tokens) and whole[:len(context_tokens)] == context_tokens:
        return context_tokens, whole[len(context_tokens):]
    return context_tokens, tokenize(continuation)


def mean_and_stderr(values: list[float]) -> tuple[float, float | None]:
    """Mean and lm-eval's stderr (sample standard deviation / sqrt(n); None when n < 2) of per-example scores."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))  # first index among equals


def evaluate_task(task: Task, tokenize: Callable[[str], list[int]], forward_logprobs: LogprobFn, *,
                  max_length: int, batch_size: int, progress: Callable[[int, int], None] | None = None
                  ) -> dict[str, Any]:
    """Scores every example of `task`; returns {"task", "type", "num_examples", metrics and their stderr}."""
    examples = read_examples(task)
    requests, owners = [], []  # owners[k] = (example index, choice index) of requests[k]
    for e, example in enumerate(examples):
        for c, choice in enumerate(example.choices):
            context_tokens, continuation_tokens = encode_pair(
                tokenize, example.context, join_continuation(example.context, choice))
            if not context_tokens:
                raise ValueError(f"tasks[{task.name}]: example {e + 1} of {task.path!r} has an empty context")
            requests.append((context_tokens, continuation_tokens))
            owners.append((e, c))
    scores = loglikelihood(requests, forward_logprobs, max_length=max_length, batch_size=batch_size,
                           progress=progress)
    per_example: list[list[tuple[float, bool]]] = [[] for _ in examples]
    for (e, _), score in zip(owners, scores):
        per_example[e].append(score)

    result: dict[str, Any] = {"task": task.name, "type": task.kind, "num_examples": len(examples)}
    if task.kind == "last_word":
        acc, acc_stderr = mean_and_stderr([float(s[0][1]) for s in per_example])
        mean_loglik = sum(s[0][0] for s in per_example) / len(examples)
        result.update(acc=acc, acc_stderr=acc_stderr, ppl=_safe_exp(-mean_loglik))
    else:
        hits, norm_hits = [], []
        for example, choice_scores in zip(examples, per_example):
            logliks = [loglik for loglik, _ in choice_scores]
            hits.append(float(_argmax(logliks) == example.gold))
            normalized = [loglik / len(choice) for loglik, choice in zip(logliks, example.choices)]
            norm_hits.append(float(_argmax(normalized) == example.gold))
        acc, acc_stderr = mean_and_stderr(hits)
        acc_norm, acc_norm_stderr = mean_and_stderr(norm_hits)
        result.update(acc=acc, acc_stderr=acc_stderr, acc_norm=acc_norm, acc_norm_stderr=acc_norm_stderr)
    return result


def _safe_exp(x: float) -> float:
    return math.exp(x) if x < 700.0 else math.inf  # math.exp raises past ~709
