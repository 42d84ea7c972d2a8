"""A built-in next-line task on the demo corpus: a signal a model trained for a minute can already show.

Construction (deterministic for given corpus files, num_examples and seed):

1. Read the corpus documents (JSON lines with "text"; the demo corpus cuts stdlib modules into functions and
   classes). A line is *usable* when it is code (not a comment, not inside or opening a triple-quoted
   string; the quotes are counted per line, which is close enough for library code) and has at least three
   space-separated words once its indentation is set aside.
2. An example is a usable line that follows at least two non-blank lines of its document. The context is up
   to 6 lines before it (fewer when that passes 400 characters), ending with a newline; the true choice is
   the line itself, indentation included. Documents are shuffled with the seed and visited round-robin,
   one random position from each per round, so examples spread over the corpus.
3. The three distractors are the same line with its words in another order: same indentation, same
   characters, same length (so `acc` and `acc_norm` agree, and neither length nor character frequencies
   tell the choices apart). Each looks like code on its own, but only a model that has learned how Python
   statements are put together (and which names the context just used, and where) prefers the true order.
   A line whose words allow fewer than three distinct reorderings is not used.
4. The gold position is drawn uniformly from 0..3, so chance is 25%.

Lines from other documents made poor distractors: a small model scores a whole line mostly by how common its
tokens are, which says nothing about the context. In a trial with a character-level 4-layer model trained
for 400 steps on the demo corpus, such distractors left it at chance (19% of 200). Reordered words give
24% untrained, 76% after 400 steps and 93% after 1500 (300 examples): better models score higher.

The output is a multiple_choice file for `runtime.evaluate.tasks`: {"context", "choices", "gold", "source"}.
The context ends with a newline, so the choices are scored exactly as written (see `join_continuation`).
"""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from runtime.io.files import atomic_write_bytes

NUM_CHOICES = 4
_CONTEXT_LINES = 6
_CONTEXT_CHARS = 400
_MIN_WORDS = 3
_ENUMERATE_UP_TO = 6  # words; longer lines are shuffled at random instead of listing every order


def _read_documents(paths: list[str]) -> list[tuple[str, list[str]]]:
    """(source, lines) for every document, in file order."""
    documents = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: expected a JSON object with key 'text'") from None
                documents.append((f"{Path(path).name}:{number}", text.replace("\r\n", "\n").split("\n")))
    return documents


def _positions(lines: list[str]) -> list[int]:
    """Indices of usable lines (see the module docstring) after at least two non-blank lines."""
    found, non_blank, in_string = [], 0, False
    for i, line in enumerate(lines):
        quotes = line.count('"""') + line.count("'''")
        code = not in_string and quotes == 0 and not line.lstrip().startswith("#")
        if code and non_blank >= 2 and len(line.split()) >= _MIN_WORDS:
            found.append(i)
        in_string ^= quotes % 2 == 1
        non_blank += bool(line.strip())
    return found


def _context(lines: list[str], index: int) -> str:
    chosen = lines[max(0, index - _CONTEXT_LINES):index]
    # Drop whole lines from the front past the character budget, but always keep the line just before.
    while len(chosen) > 1 and sum(len(line) + 1 for line in chosen) > _CONTEXT_CHARS:
        chosen = chosen[1:]
    return "\n".join(chosen) + "\n"


def _reorderings(rng: random.Random, line: str) -> list[str] | None:
    """Three distinct reorderings of the line's words (indentation kept), or None when there are fewer."""
    indent = line[:len(line) - len(line.lstrip(" \t"))]
    words = line[len(indent):].split(" ")  # split on single spaces, so a reordering has the same characters
    if "" in words:
        return None  # runs of spaces (aligned code, trailing blanks) would leak into the indentation
    if len(words) <= _ENUMERATE_UP_TO:
        orders = [list(order) for order in itertools.permutations(words)]
        rng.shuffle(orders)
    else:
        orders = [rng.sample(words, len(words)) for _ in range(16)]
    found: list[str] = []
    for order in orders:
        candidate = indent + " ".join(order)
        if candidate != line and candidate not in found:
            found.append(candidate)
            if len(found) == NUM_CHOICES - 1:
                return found
    return None


def build_demo_task(corpus_jsonl_paths: list[str], out_path: str, num_examples: int = 200, seed: int = 0) -> str:
    """Writes the next-line multiple-choice task (atomically) and returns out_path. See the module docstring."""
    if num_examples < 1:
        raise ValueError(f"build_demo_task: num_examples must be >= 1, got {num_examples}")
    rng = random.Random(seed)
    documents = _read_documents(corpus_jsonl_paths)

    # Each document's positions in a seeded order; documents visited round-robin in a seeded order.
    queues = []
    for d, (_, lines) in enumerate(documents):
        positions = _positions(lines)
        rng.shuffle(positions)
        if positions:
            queues.append((d, positions))
    rng.shuffle(queues)

    records: list[str] = []
    while len(records) < num_examples and any(positions for _, positions in queues):
        for d, positions in queues:
            if not positions or len(records) == num_examples:
                continue
            source, lines = documents[d]
            index = positions.pop()
            choices = _reorderings(rng, lines[index])
            if choices is None:
                continue
            gold = rng.randrange(NUM_CHOICES)
            choices.insert(gold, lines[index])
            record = {"context": _context(lines, index), "choices": choices, "gold": gold, "source": source}
            records.append(json.dumps(record) + "\n")
    if len(records) < num_examples:
        raise ValueError(f"build_demo_task: num_examples={num_examples} but the corpus "
                         f"{corpus_jsonl_paths} has only {len(records)} usable lines")
    atomic_write_bytes(out_path, "".join(records).encode("utf-8"))
    return out_path
