"""Preference pairs tokenized once, truncated, cached: the rows DPO and ORPO train on.

Each pair is two examples that share their first P tokens, the prompt: prompt + chosen and prompt + rejected,
rendered by the chat template and tokenized piece by piece as in SFT (runtime/schema/chat.py). The prompt ends
with the generation header (<|im_start|>assistant\\n): the header is context both responses are scored under,
so it belongs to the prompt. The loss mask is 1 on the response's assistant tokens (with the end-of-turn marker
the template writes, so stopping is part of what is compared) and 0 everywhere in the prompt, including the
assistant turns of a multi-turn prompt.

Tokenizing and truncating (keep_start cuts a long prompt, keep_end refuses it by file:line, responses are cut to
fit, a pair without a loss token left is dropped: stats["dropped"]) are runtime/schema/preference_pairs.py's, which
a launch runs on small local files too; this module stores the result as arrays, in worker processes.

An example of n tokens fills n - 1 positions of a row, exactly like SFT's rows: input_ids t[:-1], labels t[1:],
loss_mask m[1:], then padding (pad id, label 0, mask 0). Pairs are not packed: DPO compares the two sums of
log-probabilities of one pair, which one row per response keeps simple.

The cache stores each kept pair's tokens once (prompt, chosen response, rejected response) and their bounds;
rows are assembled in __getitem__. It shares runtime/sft/dataset.py's writer: arrays with checksums, the
description last, a damaged file named and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.schema.chat import ChatTokenizer
from runtime.schema.preference_pairs import (DEFAULT_LIMIT_KEY, IDENTICAL_KEY, IDENTICAL_PAIRS, Limits,
                                             check_limits, chunks, encode_pairs, every_pair_dropped,
                                             identical_pairs_problem)
from runtime.schema.records import FILES_KEY, PreferenceRecord, read_all_preferences
from runtime.sft.dataset import _digest, cached_arrays
from runtime.workers import OrderedPool

# Bump when tokenizing or truncating changes, so stale caches are never reused.
_FORMAT = 1
# tokens: each kept pair's prompt, chosen response and rejected response, back to back (int32) | loss: their
# loss flags | bounds: per pair [start, prompt end, chosen end, rejected end] in tokens | records: the pair's
# record number in the files (dropped pairs leave gaps)
_ARRAYS = ("tokens", "loss", "bounds", "records")


class PreferenceDataset(Sequence):
    """ds[i]: (2, 4, seq_length) int64; [0] the chosen side, [1] the rejected side; fields input_ids, labels,
    loss_mask, and i repeated (the trainer looks up the pair's cached reference log-probabilities with it).

    stats: pairs (records read), kept, dropped (a response without a loss token left after truncation),
    truncated (kept pairs with a prompt or a response cut), prompts_truncated, prompt_tokens, response_tokens
    (chosen + rejected, after truncation), loss_tokens, identical (pairs dropped for chosen == rejected).
    cache_key names the tokenized content; cache_dir is where it lives (the trainer keeps
    f"ref_{cache_key}_{model_key}.npy" beside it)."""

    def __init__(self, arrays: dict[str, np.ndarray], seq_length: int, pad_id: int, stats: dict, cache_key: str,
                 cache_dir: Path):
        self.arrays, self.seq_length, self.pad_id, self.stats = arrays, seq_length, pad_id, stats
        self.cache_key, self.cache_dir = cache_key, cache_dir

    def __len__(self) -> int:
        return len(self.arrays["bounds"])

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} is outside the {len(self)} pairs of the preference dataset")
        index %= len(self)
        tokens, loss = self.arrays["tokens"], self.arrays["loss"]
        start, prompt_end, chosen_end, rejected_end = (int(v) for v in self.arrays["bounds"][index])
        sample = np.zeros((2, 4, self.seq_length), dtype=np.int64)  # (side, field, position)
        for side, (a, b) in enumerate(((prompt_end, chosen_end), (chosen_end, rejected_end))):
            ids = np.concatenate([tokens[start:prompt_end], tokens[a:b]])
            mask = np.concatenate([loss[start:prompt_end], loss[a:b]])
            width = len(ids) - 1
            sample[side, 0, :width] = ids[:-1]
            sample[side, 0, width:] = self.pad_id
            sample[side, 1, :width] = ids[1:]
            sample[side, 2, :width] = mask[1:]
        sample[:, 3, :] = index
        return sample


def build_preference_dataset(files: list[str | os.PathLike], tokenizer_path: str | os.PathLike, seq_length: int, *,
                             chat_template: str | None = None, max_prompt_length: int,
                             truncation_mode: str = "keep_start", limit_key: str = DEFAULT_LIMIT_KEY,
                             identical_pairs: str = "error", cache_dir: str | os.PathLike | None = None,
                             num_workers: int = 1, is_builder: bool = True,
                             barrier: Callable[[], None] | None = None) -> PreferenceDataset:
    """Tokenize and truncate the pairs of `files` once; every later call (and every rank) reads the cache.

    Only `is_builder` writes the cache; `barrier` (when given) runs after it, so the others find it complete.
    `limit_key` is the config key of max_prompt_length, named in errors. Pairs whose chosen equals rejected are
    refused (identical_pairs "error") or dropped with a warning ("drop"; stats["identical"])."""
    limits = check_limits(seq_length, max_prompt_length, truncation_mode, limit_key)
    if problem := IDENTICAL_PAIRS.problem(IDENTICAL_KEY, identical_pairs):
        raise ValueError(problem)
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError(f"no preference files; list them in {FILES_KEY}")
    chat = ChatTokenizer(tokenizer_path, chat_template)
    params = {"format": _FORMAT, "files": [_digest(f) for f in files],
              "tokenizer": _digest(chat.tokenizer_json), "tokenizer_config": _digest(chat.config_json),
              "template": chat.template_text, "seq_length": limits.seq_length,
              "max_prompt_length": limits.max_prompt_length, "truncation_mode": limits.truncation_mode,
              "identical_pairs": identical_pairs}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    directory = Path(cache_dir) if cache_dir else Path(files[0]).parent / ".nxdt_preference_cache"
    description = directory / f"pairs_{key}.json"

    def build() -> tuple[dict[str, np.ndarray], dict]:
        return _encode(read_all_preferences(files), chat, tokenizer_path, chat_template, limits, num_workers,
                       files, identical_pairs)

    cached = cached_arrays(description, build, params, names=_ARRAYS, what="preference", is_builder=is_builder,
                           barrier=barrier)
    return PreferenceDataset(cached[0], limits.seq_length, chat.pad_id, cached[1], key, directory)


def _encode(records: list[PreferenceRecord], chat: ChatTokenizer, tokenizer_path, chat_template: str | None,
            limits: Limits, num_workers: int, files: list[str], identical_pairs: str = "error"
            ) -> tuple[dict[str, np.ndarray], dict]:
    """The cache arrays and stats of `records`, in order; in worker processes when num_workers > 1."""
    pieces = chunks(records, num_workers)
    if num_workers > 1 and len(pieces) > 1:
        # runtime/workers.py: spawned workers, and a worker that dies is an error (multiprocessing.Pool hangs).
        with OrderedPool(num_workers, _start_worker, (os.fspath(tokenizer_path), chat_template)) as pool:
            # in the chunks' order, so the result equals one worker's
            parts = list(pool.map(_encode_chunk, [(chunk, limits) for chunk in pieces]))
    else:
        parts = [_encode_chunk(chunk, limits, chat) for chunk in pieces]
    token_offsets = np.cumsum([0] + [len(p["tokens"]) for p in parts])
    record_offsets = np.cumsum([0] + [len(chunk) for chunk in pieces])
    bounds = np.concatenate([p["bounds"] + token_offsets[i] for i, p in enumerate(parts)]).reshape(-1, 4)
    arrays = {"tokens": np.concatenate([p["tokens"] for p in parts]),
              "loss": np.concatenate([p["loss"] for p in parts]), "bounds": bounds.astype(np.int64),
              "records": np.concatenate([p["records"] + record_offsets[i] for i, p in enumerate(parts)])}
    counts = np.sum([p["counts"] for p in parts], axis=0)
    identical = [where for p in parts for where in p["identical"]]
    if identical and (identical_pairs == "error" or len(bounds) == 0):  # before anything is cached
        raise ValueError(identical_pairs_problem(identical))
    if identical:
        print(f"warning: dropped {len(identical)} preference pairs whose chosen equals rejected (the first at "
              f"{identical[0]}; {IDENTICAL_KEY}=drop)", file=sys.stderr, flush=True)
    if len(bounds) == 0:
        raise ValueError(every_pair_dropped(files, limits))
    stats = {"pairs": len(records), "kept": len(bounds), "dropped": int(counts[0]), "truncated": int(counts[1]),
             "prompts_truncated": int(counts[2]), "prompt_tokens": int((bounds[:, 1] - bounds[:, 0]).sum()),
             "response_tokens": int((bounds[:, 3] - bounds[:, 1]).sum()),
             "loss_tokens": int(arrays["loss"].sum()), "identical": len(identical)}
    return arrays, stats


_worker_chat: ChatTokenizer | None = None


def _start_worker(tokenizer_path: str, chat_template: str | None) -> None:
    global _worker_chat
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; threads per worker oversubscribe
    _worker_chat = ChatTokenizer(tokenizer_path, chat_template)


def _encode_chunk(records: list[PreferenceRecord], limits: Limits,
                  chat: ChatTokenizer | None = None) -> dict[str, np.ndarray]:
    """One chunk's tokens, loss flags, bounds (from the chunk's first token), record numbers (from its first
    record) and counts [dropped, truncated, prompts truncated]."""
    pairs = encode_pairs(records, limits, chat or _worker_chat)
    return {"tokens": np.array(pairs.tokens, dtype=np.int32), "loss": np.array(pairs.loss, dtype=np.uint8),
            "bounds": np.array(pairs.bounds, dtype=np.int64).reshape(-1, 4),
            "records": np.array(pairs.kept, dtype=np.int64), "counts": np.array(pairs.counts, dtype=np.int64),
            "identical": pairs.identical}
