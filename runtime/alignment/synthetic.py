"""A synthetic preference set whose rule a tiny model learns from preferences alone, so DPO shows as accuracy.

    # train / valid / test preference pairs, a small byte-level BPE and its ChatML tokenizer_config.json
    python -m runtime.alignment.synthetic --output-dir data/preference_demo
    python -m runtime.alignment.synthetic --output-dir data/preference_demo --num-train 20000 --seed 7

Each record is {"prompt": ..., "chosen": ..., "rejected": ...}: the prompt is one of the SFT demo's tasks
(runtime/sft/synthetic.py: reverse words, sort digits, add, upper-case words, fill a format), chosen its exact
answer, rejected a plausible wrong answer made by the task's one typical mistake (CORRUPTIONS below).

Why this rule. DPO here starts from a random model that is also its reference, so nothing is known to begin
with: every bit of the rule comes from comparing the two responses. It has to be learnable from a few thousand
pairs and carry over to prompts never seen, so each mistake shows in the response's own tokens, whatever the
prompt's particular words or numbers:
  - reverse -> the letters reversed instead of the words ("cat dog" -> "god tac"): reversed words are tokens
    no right answer contains;
  - sort    -> the digits in the prompt's order (descending when the prompt happens to be sorted): a step down
    between neighbouring digits, which a sorted answer never has;
  - add     -> the operands' digits concatenated ("12 + 34" -> "1234", a string join): a fourth digit, where a
    sum of two two-digit numbers ends after three at most;
  - upper   -> the words left in lower case;
  - format  -> the age written as a JSON string ("age": "42"): a quote where a number belongs.
Both responses of a pair are about as long (within two tokens), so response length says little on its own.

Measured (defaults, seeds 1234 and 7; a plain DPO loop, not yet the trainer): the tiny Llama (4 layers, hidden
128, 4 heads, 2 KV groups, ffn 352) from random init, reference = that init, sigmoid loss with beta 0.1, 16 pairs
per step, AdamW lr 5e-4, 1e-3 or 3e-3 with 20 warmup steps, reaches held-out reward accuracy 0.97-0.99 at step
50 and 0.99-1.0 from step 100 on (every task >= 0.95), at about 0.5 s a step on one CPU thread (seq 64).
Mistakes that need the model to compute the right answer were tried and left out: words copied in the prompt's
order (instead of reversed) stayed at 0.47 and a sum off by one at 0.50, chance, after 300 steps; SFT needs
~1000 steps of full supervision for those skills, and a preference carries far less signal than a target.
"""
from __future__ import annotations

import json
import os
import random
import sys
from typing import Callable

from runtime.sft.synthetic import TASKS, _check_counts, demo_main, write_demo_files


def _unsorted(prompt: str, answer: str) -> str | None:
    digits = prompt.split(": ", 1)[1]
    if digits != answer:
        return digits
    descending = " ".join(reversed(answer.split()))
    return descending if descending != answer else None  # all digits equal: every order is right


def _concatenated(prompt: str, answer: str) -> str | None:
    a, _, b = prompt.split(": ", 1)[1].split()
    return a + b


def _letters_reversed(prompt: str, answer: str) -> str | None:
    words = prompt.split(": ", 1)[1]
    return words[::-1] if words[::-1] != answer else None


def _lower(prompt: str, answer: str) -> str | None:
    return answer.lower()


def _age_as_string(prompt: str, answer: str) -> str | None:
    fields = json.loads(answer)
    return json.dumps({**fields, "age": str(fields["age"])})


# Task name -> the mistake its rejected answer makes (None: no wrong answer of that kind; the prompt is redrawn).
CORRUPTIONS: dict[str, Callable[[str, str], str | None]] = {
    "reverse": _letters_reversed, "sort": _unsorted, "add": _concatenated, "upper": _lower, "format": _age_as_string}


def make_splits(num_train: int, num_valid: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """Distinct prompts, tasks in turn; test drawn first, then valid, then train, so a larger num_train keeps
    the same test set and no prompt is in two splits."""
    _check_counts(num_train=num_train, num_valid=num_valid, num_test=num_test)
    rng, names = random.Random(seed), list(CORRUPTIONS)
    total = num_test + num_valid + num_train
    seen: set[str] = set()
    records: list[dict] = []
    while len(records) < total:
        task = names[len(records) % len(names)]
        for _ in range(1000):  # a repeat (or a prompt without a wrong answer) is redrawn
            prompt, answer = TASKS[task](rng)
            rejected = None if prompt in seen else CORRUPTIONS[task](prompt, answer)
            if rejected is not None:
                break
        else:
            raise ValueError(f"num_train + num_valid + num_test = {total} is more than the {task!r} task has "
                             f"distinct prompts for (it ran out after {len(records) // len(names)}); "
                             "ask for fewer pairs")
        assert rejected != answer, (prompt, answer)
        seen.add(prompt)
        records.append({"prompt": prompt, "chosen": answer, "rejected": rejected})
    return {"test": records[:num_test], "valid": records[num_test:num_test + num_valid],
            "train": records[num_test + num_valid:]}


def task_of(record: dict) -> str:
    """The task (and so the mistake) of a record: every prompt starts "<task>: "."""
    return record["prompt"].split(":", 1)[0]


def write_demo(output_dir: str | os.PathLike, *, num_train: int = 20000, num_valid: int = 256,
               num_test: int = 512, seed: int = 1234, vocab_size: int = 512) -> bool:
    """Writes train/valid/test.jsonl, tokenizer.json, tokenizer_config.json and summary.json into output_dir.

    Returns False, writing nothing, when summary.json says the same arguments were already written. Each file
    is replaced atomically and summary.json goes last, so an interrupted run is redone, never taken as done.
    """
    _check_counts(num_train=num_train, num_valid=num_valid, num_test=num_test)
    # The mistakes too: a directory written before one was changed is not the same data.
    settings = {"num_train": num_train, "num_valid": num_valid, "num_test": num_test, "seed": seed,
                "vocab_size": vocab_size, "corruptions": {task: f.__name__.lstrip("_")
                                                          for task, f in CORRUPTIONS.items()}}
    # Role names too, so "user" and "assistant" become single tokens; both responses, so each is spelled alike.
    return write_demo_files(
        output_dir, settings, lambda: make_splits(num_train, num_valid, num_test, seed),
        lambda train: [text for r in train for text in ("user", "assistant", r["prompt"], r["chosen"],
                                                        r["rejected"])],
        task_of, CORRUPTIONS)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, prog="python -m runtime.alignment.synthetic", write=write_demo, noun="pairs",
                     description="Write a synthetic preference dataset (prompt, chosen, rejected) and its tokenizer.",
                     num_valid=256, num_test=512)


if __name__ == "__main__":
    sys.exit(main())
