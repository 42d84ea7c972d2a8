"""The exact_match task: generate an answer to each chat record's prompt and compare it with the record's answer.

    {name: sft_demo_test, type: exact_match, path: data/sft_demo/test.jsonl, limit: 200, max_new_tokens: 48,
     baseline: true, chat_template: null}

The file holds chat records as fine-tuning reads them (runtime/schema/records.py: {"messages": [...]} or
{"prompt", "completion"}). The prompt is every message before the record's last assistant message, rendered with
the chat template and its generation prompt exactly as fine-tuning rendered it (runtime/schema/chat.py); the
reference is that last message's content. Decoding is greedy, up to max_new_tokens or the template's end of turn.
`exact_match` is the fraction of records whose decoded completion, stripped of surrounding whitespace, equals the
stripped reference; `exact_match_stderr` the sample standard deviation / sqrt(n), as for acc.

baseline: true scores the weights the checkpoint's run started from as well (runtime/evaluate/model.py
load_baseline), as `baseline_exact_match`: before and after fine-tuning, in one report. chat_template: a built-in
name, or null for the template the run trained with (its model.data.chat_template, else the tokenizer's own).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.evaluate.tasks import mean_and_stderr
from runtime.generate import generate


@dataclass(frozen=True)
class ExactMatchTask:
    name: str
    path: str
    limit: int | None
    max_new_tokens: int
    baseline: bool
    chat_template: str | None       # None: the run's, else the tokenizer's


def load_exact_match(name: str, options: dict[str, Any]) -> ExactMatchTask:
    """From the options runtime/schema/evaluation.py typed; reads the file once, so a bad record fails (one line,
    file:line) before the model loads."""
    from runtime.schema.records import read_records

    task = ExactMatchTask(name=name, **options)
    if not Path(task.path).is_file():
        raise ValueError(f"tasks[{name}].path: no such file {task.path!r}; write chat records there (for the demo: "
                         f"python -m runtime.sft.synthetic --output-dir <dir>)")
    read_records(task.path)
    return task


def chat_examples(task: ExactMatchTask, tokenizer_path: str, chat_template: str | None):
    """(the ChatTokenizer, [(prompt ids, reference text)]): the one place this task meets runtime/schema/chat.py."""
    from runtime.schema.chat import ChatTokenizer, generation_examples

    try:
        chat = ChatTokenizer(tokenizer_path, task.chat_template or chat_template)
    except ValueError as error:  # its advice names the training key; here the task's own key works too
        raise ValueError(f"tasks[{task.name}]: {error} (or the task's chat_template)") from None
    return chat, generation_examples([task.path], chat, task.limit)


def run_generation(model: torch.nn.Module, prompts: list[list[int]], *, max_new_tokens: int, stop_ids,
                   pad_id: int, vocab_size: int, batch_size: int, max_length: int,
                   progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Greedy completions of every prompt, in batches of similar lengths (less padding); prompts longer than
    max_length - max_new_tokens keep their last tokens, as lm-eval truncates contexts."""
    keep = max(1, max_length - max_new_tokens)
    prompts = [p[-keep:] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    completions: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        outs = generate(model, [prompts[i] for i in batch], max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                        pad_id=pad_id, vocab_size=vocab_size)
        for i, out in zip(batch, outs):
            completions[i] = out
        if progress is not None:
            progress(start + len(batch), len(prompts))
    return completions


def evaluate_exact_match(task: ExactMatchTask, model: torch.nn.Module, *, tokenizer_path: str,
                         chat_template: str | None, batch_size: int, max_length: int,
                         baseline: tuple[torch.nn.Module, str] | None = None,
                         progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, Any], list[dict]]:
    """(the result for the report, one row per record: reference, completion, correct, and the baseline's).

    baseline: (the starting weights, what they are), scored the same way when given."""
    chat, examples = chat_examples(task, tokenizer_path, chat_template)
    prompts = [prompt for prompt, _ in examples]
    settings = dict(max_new_tokens=task.max_new_tokens, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    vocab_size=chat.tokenizer.get_vocab_size(with_added_tokens=True), batch_size=batch_size,
                    max_length=max_length)
    rows = [{"reference": reference} for _, reference in examples]
    result: dict[str, Any] = {"task": task.name, "type": "exact_match", "num_examples": len(examples)}
    runs = [("", model)] + ([("baseline_", baseline[0])] if baseline is not None else [])
    for number, (prefix, weights) in enumerate(runs):
        def report(done: int, total: int, before: int = number * len(prompts)) -> None:  # one count over both runs
            if progress is not None:
                progress(before + done, total * len(runs))

        completions = run_generation(weights, prompts, progress=report, **settings)
        hits = []
        for row, tokens in zip(rows, completions):
            text = chat.decode(tokens)
            row[f"{prefix}completion"], row[f"{prefix}correct"] = text, text.strip() == row["reference"].strip()
            hits.append(float(row[f"{prefix}correct"]))
        result[f"{prefix}exact_match"], result[f"{prefix}exact_match_stderr"] = mean_and_stderr(hits)
    if baseline is not None:
        result["baseline"] = baseline[1]
    return result, rows
