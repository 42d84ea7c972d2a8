"""Preference pairs tokenized once, truncated, cached: the rows DPO and ORPO train on.

Each pair is two examples that share their first P tokens, the prompt: prompt + chosen and prompt + rejected,
rendered by the chat template and tokenized piece by piece as in SFT (runtime/sft/chat.py). The prompt ends
with the generation header (<|im_start|>assistant\\n): the header is context both responses are scored under,
so it belongs to the prompt. The loss mask is 1 on the response's assistant tokens (with the end-of-turn marker
the template writes, so stopping is part of what is compared) and 0 everywhere in the prompt, including the
assistant turns of a multi-turn prompt.

Truncation (NxD Training's truncation_mode), prompt first, then the responses:
    P > max_prompt_length:  keep_start keeps the prompt's first max_prompt_length tokens;
                            keep_end refuses the pair by file:line (it never cuts a prompt)
    each response:          cut at its end so that prompt + response <= seq_length + 1 tokens
    a pair where either response has no loss token left is dropped (stats["dropped"])
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
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from runtime.alignment.records import FILES_KEY, PreferenceRecord, read_all_preferences, read_preference_records
from runtime.schema.choices import PROMPT_TRUNCATIONS
from runtime.sft.chat import ChatTokenizer
from runtime.sft.dataset import _digest, cached_arrays
from runtime.workers import OrderedPool

# Bump when tokenizing or truncating changes, so stale caches are never reused.
_FORMAT = 1
# tokens: each kept pair's prompt, chosen response and rejected response, back to back (int32) | loss: their
# loss flags | bounds: per pair [start, prompt end, chosen end, rejected end] in tokens | records: the pair's
# record number in the files (dropped pairs leave gaps)
_ARRAYS = ("tokens", "loss", "bounds", "records")
DEFAULT_LIMIT_KEY = "model_alignment_strategy.dpo.max_dpo_prompt_length"


class _Limits(NamedTuple):
    seq_length: int
    max_prompt_length: int
    truncation_mode: str
    limit_key: str


class PreferenceDataset(Sequence):
    """ds[i]: (2, 4, seq_length) int64; [0] the chosen side, [1] the rejected side; fields input_ids, labels,
    loss_mask, and i repeated (the trainer looks up the pair's cached reference log-probabilities with it).

    stats: pairs (records read), kept, dropped (a response without a loss token left after truncation),
    truncated (kept pairs with a prompt or a response cut), prompts_truncated, prompt_tokens, response_tokens
    (chosen + rejected, after truncation), loss_tokens. cache_key names the tokenized content; cache_dir is where
    it lives (the trainer keeps f"ref_{cache_key}_{model_key}.npy" beside it)."""

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
                             cache_dir: str | os.PathLike | None = None, num_workers: int = 1,
                             is_builder: bool = True, barrier: Callable[[], None] | None = None) -> PreferenceDataset:
    """Tokenize and truncate the pairs of `files` once; every later call (and every rank) reads the cache.

    Only `is_builder` writes the cache; `barrier` (when given) runs after it, so the others find it complete.
    `limit_key` is the config key of max_prompt_length, named in errors."""
    limits = _check_limits(seq_length, max_prompt_length, truncation_mode, limit_key)
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError(f"no preference files; list them in {FILES_KEY}")
    chat = ChatTokenizer(tokenizer_path, chat_template)
    params = {"format": _FORMAT, "files": [_digest(f) for f in files],
              "tokenizer": _digest(chat.tokenizer_json), "tokenizer_config": _digest(chat.config_json),
              "template": chat.template_text, "seq_length": limits.seq_length,
              "max_prompt_length": limits.max_prompt_length, "truncation_mode": limits.truncation_mode}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    directory = Path(cache_dir) if cache_dir else Path(files[0]).parent / ".nxdt_preference_cache"
    description = directory / f"pairs_{key}.json"

    def build() -> tuple[dict[str, np.ndarray], dict]:
        return _encode(read_all_preferences(files), chat, tokenizer_path, chat_template, limits, num_workers,
                       files)

    cached = cached_arrays(description, build, params, names=_ARRAYS, what="preference", is_builder=is_builder,
                           barrier=barrier)
    return PreferenceDataset(cached[0], limits.seq_length, chat.pad_id, cached[1], key, directory)


def check_preference_file(path: str | os.PathLike, tokenizer_path: str | os.PathLike, chat_template: str | None,
                          seq_length: int, max_prompt_length: int, truncation_mode: str,
                          limit_key: str = DEFAULT_LIMIT_KEY) -> None:
    """The first problem of one file as a one-line ValueError (a bad record, a prompt over the limit under
    keep_end, no pair left after truncation); the launcher runs it on small local files before queueing."""
    limits = _check_limits(seq_length, max_prompt_length, truncation_mode, limit_key)
    chat = ChatTokenizer(tokenizer_path, chat_template)
    _encode(read_preference_records(path), chat, tokenizer_path, chat_template, limits, 1, [os.fspath(path)])


def _check_limits(seq_length: int, max_prompt_length: int, truncation_mode: str, limit_key: str) -> _Limits:
    mode_key = f"{limit_key.rpartition('.')[0]}.truncation_mode" if "." in limit_key else "truncation_mode"
    if problem := PROMPT_TRUNCATIONS.problem(mode_key, truncation_mode):
        raise ValueError(problem)
    if int(seq_length) < 1:
        raise ValueError(f"model.data.seq_length = {seq_length}; it must be a positive number of tokens")
    if int(max_prompt_length) < 1:
        raise ValueError(f"{limit_key} = {max_prompt_length}; it must be a positive number of tokens (below "
                         "model.data.seq_length, to leave room for the responses)")
    return _Limits(int(seq_length), int(max_prompt_length), truncation_mode, limit_key)


def _encode(records: list[PreferenceRecord], chat: ChatTokenizer, tokenizer_path, chat_template: str | None,
            limits: _Limits, num_workers: int, files: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The cache arrays and stats of `records`, in order; in worker processes when num_workers > 1."""
    size = max(1, min(2048, math.ceil(len(records) / (4 * max(1, num_workers)))))
    chunks = [records[i:i + size] for i in range(0, len(records), size)]
    if num_workers > 1 and len(chunks) > 1:
        # runtime/workers.py: spawned workers, and a worker that dies is an error (multiprocessing.Pool hangs).
        with OrderedPool(num_workers, _start_worker, (os.fspath(tokenizer_path), chat_template)) as pool:
            # in the chunks' order, so the result equals one worker's
            parts = list(pool.map(_encode_chunk, [(chunk, limits) for chunk in chunks]))
    else:
        parts = [_encode_chunk(chunk, limits, chat) for chunk in chunks]
    token_offsets = np.cumsum([0] + [len(p["tokens"]) for p in parts])
    record_offsets = np.cumsum([0] + [len(chunk) for chunk in chunks])
    bounds = np.concatenate([p["bounds"] + token_offsets[i] for i, p in enumerate(parts)]).reshape(-1, 4)
    arrays = {"tokens": np.concatenate([p["tokens"] for p in parts]),
              "loss": np.concatenate([p["loss"] for p in parts]), "bounds": bounds.astype(np.int64),
              "records": np.concatenate([p["records"] + record_offsets[i] for i, p in enumerate(parts)])}
    counts = np.sum([p["counts"] for p in parts], axis=0)
    if len(bounds) == 0:
        raise ValueError(f"every pair of {', '.join(files)} was dropped: none leaves a response token within "
                         f"model.data.seq_length = {limits.seq_length} after a prompt of up to {limits.limit_key} = "
                         f"{limits.max_prompt_length} tokens; raise model.data.seq_length or lower "
                         f"{limits.limit_key}")
    stats = {"pairs": len(records), "kept": len(bounds), "dropped": int(counts[0]), "truncated": int(counts[1]),
             "prompts_truncated": int(counts[2]), "prompt_tokens": int((bounds[:, 1] - bounds[:, 0]).sum()),
             "response_tokens": int((bounds[:, 3] - bounds[:, 1]).sum()),
             "loss_tokens": int(arrays["loss"].sum())}
    return arrays, stats


_worker_chat: ChatTokenizer | None = None


def _start_worker(tokenizer_path: str, chat_template: str | None) -> None:
    global _worker_chat
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; threads per worker oversubscribe
    _worker_chat = ChatTokenizer(tokenizer_path, chat_template)


def _encode_chunk(records: list[PreferenceRecord], limits: _Limits,
                  chat: ChatTokenizer | None = None) -> dict[str, np.ndarray]:
    """One chunk's tokens, loss flags, bounds (from the chunk's first token), record numbers (from its first
    record) and counts [dropped, truncated, prompts truncated]."""
    chat = chat or _worker_chat
    where = [r.where for r in records for _ in range(2)]
    examples = chat.encode_examples([r.prompt + side for r in records for side in (r.chosen, r.rejected)], where)
    tokens: list[int] = []
    loss: list[int] = []
    bounds, kept, counts = [], [], [0, 0, 0]
    for number, record in enumerate(records):
        (chosen, chosen_mask), (rejected, rejected_mask) = examples[2 * number], examples[2 * number + 1]
        try:
            # The template's prompt with the generation header, tokenized as the pieces before the first response
            # message are: the shared prefix both examples must start with.
            prompt = chat.prompt_ids(record.prompt + record.chosen[:1])
        except ValueError as err:
            raise ValueError(f"{record.where}: {err}") from None
        length = len(prompt)
        if chosen[:length] != prompt or rejected[:length] != prompt:
            raise ValueError(f"{record.where}: chat template {chat.name} does not render the prompt the same before "
                             "chosen and rejected, so the pair has no shared prompt; use a prefix-stable template")
        prompt_cut = length > limits.max_prompt_length
        if prompt_cut and limits.truncation_mode == "keep_end":
            raise ValueError(f"{record.where}: the prompt is {length} tokens, over {limits.limit_key}="
                             f"{limits.max_prompt_length}; truncation_mode keep_end never cuts a prompt (it keeps "
                             "the end next to the response whole): raise the limit, shorten the prompt or use "
                             "keep_start")
        prompt = prompt[:limits.max_prompt_length]
        room = max(0, limits.seq_length + 1 - len(prompt))
        responses = [(chosen[length:], chosen_mask[length:]), (rejected[length:], rejected_mask[length:])]
        cut = [(ids[:room], mask[:room]) for ids, mask in responses]
        if not all(any(mask) for _, mask in cut):  # the prompt's own tokens never carry loss
            counts[0] += 1
            continue
        counts[1] += prompt_cut or any(len(ids) > room for ids, _ in responses)
        counts[2] += prompt_cut
        start = len(tokens)
        tokens += prompt
        loss += [0] * len(prompt)
        for ids, mask in cut:
            tokens += ids
            loss += mask
        bounds.append((start, start + len(prompt), start + len(prompt) + len(cut[0][0]), len(tokens)))
        kept.append(number)
    return {"tokens": np.array(tokens, dtype=np.int32), "loss": np.array(loss, dtype=np.uint8),
            "bounds": np.array(bounds, dtype=np.int64).reshape(-1, 4), "records": np.array(kept, dtype=np.int64),
            "counts": np.array(counts, dtype=np.int64)}
