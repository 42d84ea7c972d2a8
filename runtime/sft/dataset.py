"""SFT training rows: chat records tokenized once, truncated, packed into rows of seq_length, cached.

An example's tokens t_0..t_{n-1} with assistant flags m_i fill n - 1 positions of a row: input_ids t[:-1],
labels t[1:], loss_mask m[1:], position_ids 0..n-2. Packing puts several whole examples in a row; position ids
restart at 0 at each one, which is how the model finds the boundaries it resets attention at. Padding is its
own segment: pad ids, labels 0, loss_mask 0, position ids 0, 1, 2, ...

The cache holds the tokens once plus the row layout (which examples, in which order), not the (4, seq_length)
rows themselves, which would be several times larger; rows are assembled in __getitem__.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.io.files import atomic_write_json, read_json, sha256_file, temp_name
from runtime.schema.choices import TRUNCATIONS
from runtime.schema.chat import ChatTokenizer
from runtime.schema.records import FILES_KEY, Record, read_all
from runtime.workers import OrderedPool

# Bump when tokenizing, truncating or packing changes, so stale caches are never reused.
_FORMAT = 1
# tokens: every example's ids (int32: vocabularies are far below 2**31) | loss: its assistant flags | spans: the
# [start, stop) of each kept example in tokens, after truncation | rows: row r holds row_examples[rows[r]:rows[r+1]]
_ARRAYS = ("tokens", "loss", "spans", "rows", "row_examples")


class SFTDataset(Sequence):
    """Rows of (4, seq_length) int64: input_ids, labels, loss_mask, position_ids.

    stats: examples (records read), rows, tokens (positions holding an example), loss_tokens, truncated (examples
    cut to fit and kept), dropped (left out: too long under truncation 'drop', or no loss token left),
    padding_fraction (of all rows * seq_length positions)."""

    def __init__(self, arrays: dict[str, np.ndarray], seq_length: int, pad_id: int, stats: dict):
        self.arrays, self.seq_length, self.pad_id, self.stats = arrays, seq_length, pad_id, stats

    def __len__(self) -> int:
        return len(self.arrays["rows"]) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is outside the {len(self)} rows of the SFT dataset")
        index %= len(self)
        rows, spans, tokens, loss = (self.arrays[n] for n in ("rows", "spans", "tokens", "loss"))
        sample = np.zeros((4, self.seq_length), dtype=np.int64)  # (input_ids, labels, loss_mask, position_ids)
        used = 0
        for example in self.arrays["row_examples"][rows[index]:rows[index + 1]]:
            start, stop = (int(v) for v in spans[example])
            width = stop - start - 1
            sample[0, used:used + width] = tokens[start:stop - 1]
            sample[1, used:used + width] = tokens[start + 1:stop]
            sample[2, used:used + width] = loss[start + 1:stop]
            sample[3, used:used + width] = np.arange(width)
            used += width
        sample[0, used:] = self.pad_id
        sample[3, used:] = np.arange(self.seq_length - used)
        return sample


def epoch_samples(dataset: Sequence, num_samples: int, seed: int) -> Sequence:
    """num_samples samples: sample j is dataset[perm_e[j % n]], e = j // n, one seeded permutation per epoch."""
    return _EpochSamples(dataset, int(num_samples), int(seed))


class _EpochSamples(Sequence):
    def __init__(self, dataset: Sequence, num_samples: int, seed: int):
        if len(dataset) == 0:
            raise ValueError(f"the SFT dataset has no rows to draw samples from; check {FILES_KEY}")
        self.dataset, self.num_samples, self.seed = dataset, num_samples, seed
        self._epoch, self._permutation = -1, np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside the {self.num_samples} samples")
        epoch, position = divmod(index, len(self.dataset))
        if epoch != self._epoch:  # reading goes epoch by epoch, so one permutation at a time is enough
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._epoch = epoch
        return self.dataset[int(self._permutation[position])]


def build_sft_dataset(files: list[str | os.PathLike], tokenizer_path: str | os.PathLike, seq_length: int, *,
                      chat_template: str | None = None, packing: bool = True, truncation: str = "right",
                      cache_dir: str | os.PathLike | None = None, num_workers: int = 1, is_builder: bool = True,
                      barrier: Callable[[], None] | None = None) -> SFTDataset:
    """Tokenize, truncate and pack `files` once; every later call (and every rank) reads the cache.

    Only `is_builder` writes the cache; `barrier` (when given) runs after it, so the others find it complete."""
    if problem := TRUNCATIONS.problem("model.data.truncation", truncation):
        raise ValueError(problem)
    if int(seq_length) < 1:
        raise ValueError(f"model.data.seq_length = {seq_length}; it must be a positive number of tokens")
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError(f"no SFT input files; list them in {FILES_KEY}")
    chat = ChatTokenizer(tokenizer_path, chat_template)
    params = {"format": _FORMAT, "files": [_digest(f) for f in files],
              "tokenizer": _digest(chat.tokenizer_json), "tokenizer_config": _digest(chat.config_json),
              "template": chat.template_text, "seq_length": int(seq_length), "packing": bool(packing),
              "truncation": truncation}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    directory = Path(cache_dir) if cache_dir else Path(files[0]).parent / ".nxdt_sft_cache"
    description = directory / f"sft_{key}.json"

    def build() -> tuple[dict[str, np.ndarray], dict]:
        tokens, loss, lengths = _encode(read_all(files), chat, tokenizer_path, chat_template, num_workers)
        return _layout(tokens, loss, lengths, int(seq_length), bool(packing), truncation, files)

    cached = cached_arrays(description, build, params, is_builder=is_builder, barrier=barrier)
    return SFTDataset(cached[0], int(seq_length), chat.pad_id, cached[1])


def cached_arrays(description: Path, build: Callable[[], tuple[dict[str, np.ndarray], dict]], params: dict, *,
                  names: tuple[str, ...] = _ARRAYS, what: str = "SFT", is_builder: bool = True,
                  barrier: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, stats) from the cache at `description`, built and written there by the builder when absent or
    damaged; the others read it after `barrier`. Shared with the preference pairs (runtime/alignment/data.py)."""
    cached = None
    if is_builder:
        try:
            cached = _load(description, names, what)
        except ValueError as err:  # a damaged cache is rebuilt, never used; say so, since it should not happen
            print(f"warning: {err}; rebuilding it", file=sys.stderr, flush=True)
        if cached is None:
            cached = build()
            _save(description, *cached, params, what)
    if barrier is not None:
        barrier()
    if not is_builder:
        cached = _load(description, names, what)
        if cached is None:  # a node-local cache_dir the builder did not write: tokenize here, in memory
            cached = build()
    return cached


def _encode(records: list[Record], chat: ChatTokenizer, tokenizer_path, chat_template: str | None,
            num_workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, loss flags, length of each example), records in order; in worker processes when num_workers > 1."""
    size = max(1, min(2048, math.ceil(len(records) / (4 * max(1, num_workers)))))
    chunks = [records[i:i + size] for i in range(0, len(records), size)]
    if num_workers > 1 and len(chunks) > 1:
        # runtime/workers.py: spawned workers, and a worker that dies is an error (multiprocessing.Pool hangs).
        with OrderedPool(num_workers, _start_worker, (os.fspath(tokenizer_path), chat_template)) as pool:
            # in the chunks' order, so the result equals one worker's
            parts = list(pool.map(_encode_chunk, [(chunk,) for chunk in chunks]))
    else:
        parts = [_encode_chunk(chunk, chat) for chunk in chunks]
    return tuple(np.concatenate([part[k] for part in parts]) for k in range(3))


_worker_chat: ChatTokenizer | None = None


def _start_worker(tokenizer_path: str, chat_template: str | None) -> None:
    global _worker_chat
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; threads per worker oversubscribe
    _worker_chat = ChatTokenizer(tokenizer_path, chat_template)


def _encode_chunk(records: list[Record], chat: ChatTokenizer | None = None):
    examples = (chat or _worker_chat).encode_examples([r.messages for r in records], [r.where for r in records])
    return (np.array([i for ids, _ in examples for i in ids], dtype=np.int32),
            np.array([m for _, mask in examples for m in mask], dtype=np.uint8),
            np.array([len(ids) for ids, _ in examples], dtype=np.int64))


def _layout(tokens: np.ndarray, loss: np.ndarray, lengths: np.ndarray, seq_length: int, packing: bool,
            truncation: str, files: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """Truncate each example to seq_length + 1 tokens, drop those without a loss token, place them in rows."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    spans, truncated, dropped = [], 0, 0
    for start, length in zip(starts.tolist(), lengths.tolist()):
        stop, cut = start + length, length > seq_length + 1
        if cut and truncation == "drop":
            dropped += 1
            continue
        if cut:
            start, stop = (start, start + seq_length + 1) if truncation == "right" else (stop - seq_length - 1, stop)
        if not loss[start + 1:stop].any():  # also examples of one token: no label to learn
            dropped += 1
            continue
        truncated += cut
        spans.append((start, stop))
    if not spans:
        also = " or set model.data.truncation to 'left' (it keeps the answers)" if truncation != "left" else ""
        raise ValueError(f"every example of {', '.join(files)} was dropped: none has an assistant token within "
                         f"model.data.seq_length = {seq_length} under model.data.truncation = {truncation!r}; raise "
                         f"model.data.seq_length{also}")
    spans_array = np.array(spans, dtype=np.int64).reshape(-1, 2)
    sizes = spans_array[:, 1] - spans_array[:, 0] - 1
    if packing:
        # First-fit decreasing: longest first, each into the first row with room (stable sort: ties in file order).
        # It leaves less padding than first-fit in file order, and the row order it gives does not matter
        # because epoch_samples shuffles the rows.
        order = np.argsort(-sizes, kind="stable")
        groups = [[int(order[i]) for i in row] for row in _first_fit(sizes[order].tolist(), seq_length)]
    else:
        groups = [[i] for i in range(len(spans))]
    rows = np.cumsum([0] + [len(g) for g in groups]).astype(np.int64)
    row_examples = np.array([i for group in groups for i in group], dtype=np.int64)
    used = int(sizes.sum())
    stats = {"examples": len(lengths), "rows": len(groups), "tokens": used,
             "loss_tokens": sum(int(loss[a + 1:b].sum()) for a, b in spans), "truncated": int(truncated),
             "dropped": dropped, "padding_fraction": 1.0 - used / (len(groups) * seq_length)}
    arrays = {"tokens": tokens, "loss": loss, "spans": spans_array, "rows": rows, "row_examples": row_examples}
    return arrays, stats


def _first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Rows of item indices: each item goes to the first row with room left. A max-tree over the rows' room finds
    that row in log(rows) steps; rows not opened yet have full room, so the leftmost fit always exists."""
    leaves = 1 << max(len(sizes) - 1, 0).bit_length()
    room = [capacity] * (2 * leaves)  # room[node] = the most room of any row under node; rows are the leaves
    rows: list[list[int]] = []
    for item, size in enumerate(sizes):
        node = 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        if node - leaves == len(rows):
            rows.append([])
        rows[node - leaves].append(item)
        room[node] -= size
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return rows


def _digest(path: str | os.PathLike) -> str:
    """Content, not path and mtime: a copy of the same data (staged to another disk) finds the same cache."""
    return sha256_file(path) if Path(path).is_file() else "absent"


def _save(description: Path, arrays: dict[str, np.ndarray], stats: dict, params: dict, what: str = "SFT") -> None:
    """Arrays first, each renamed into place whole; the description (with their checksums) last, so a reader that
    finds it finds every array complete. The preference data (runtime/alignment/data.py) shares this cache."""
    try:
        description.parent.mkdir(parents=True, exist_ok=True)
        checksums = {}
        for name in arrays:
            path = description.with_suffix(f".{name}.npy")
            temporary = temp_name(path)
            with open(temporary, "wb") as f:
                np.save(f, arrays[name])
            checksums[name] = sha256_file(temporary)
            os.replace(temporary, path)
        atomic_write_json(description, {"params": params, "stats": stats, "sha256": checksums})
    except OSError as err:
        raise ValueError(f"cannot write the {what} cache in {description.parent} ({err.strerror or err}); set the "
                         "cache directory (cache_dir) to a writable one") from None


def _load(description: Path, names: tuple[str, ...] = _ARRAYS,
          what: str = "SFT") -> tuple[dict[str, np.ndarray], dict] | None:
    """The cached arrays and stats; None when there is no cache; ValueError naming a file that does not match."""
    saved = read_json(description)
    if saved is None:
        return None
    arrays = {}
    for name in names:
        path = description.with_suffix(f".{name}.npy")
        if not path.is_file() or sha256_file(path) != saved.get("sha256", {}).get(name):
            raise ValueError(f"{path}: the {what} cache file is missing or does not match its checksum in "
                             f"{description.name}; delete {description.parent} to rebuild it")
        arrays[name] = np.load(path, mmap_mode="r")
    return arrays, saved["stats"]
