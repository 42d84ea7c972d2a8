# GPT pretraining samples over an indexed dataset: fixed-length windows of seq_length + 1 tokens that run across
# document boundaries, in a shuffled order that depends only on the seed.
#
# The idea is Megatron-LM's three index arrays, computed here with numpy instead of a C++ helper:
#   doc_idx      the split's sequences, one random permutation per epoch, epochs back to back
#   sample_idx   (num_samples + 1, 2): where sample i starts, as (position in doc_idx, token offset);
#                sample i ends where sample i + 1 starts, one token further (the shifted label)
#   shuffle_idx  a permutation of the samples, so consecutive steps do not read neighbouring text
# They are built once per (data, split, sample count, seq_length, seed) and cached as .npy files.
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.data.indexed import IndexedDataset
from runtime.schema import rules

SPLIT_NAMES = ("train", "valid", "test")
# Bump when the way the arrays are computed changes, so stale caches are never reused.
_INDEX_FORMAT = 1


def parse_splits(splits_string: str) -> list[float]:
    """'98,1,1' -> [0.98, 0.01, 0.01]; missing trailing parts count as 0, as in Megatron."""
    if problem := rules.splits(splits_string, "training."):
        raise ValueError(problem)
    parts = [float(p) for p in str(splits_string).replace("/", ",").split(",") if p.strip()]
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_document_ranges(num_documents: int, splits_string: str) -> dict[str, tuple[int, int]]:
    """Contiguous document ranges [start, stop) for train, valid and test that together cover every document."""
    fractions = parse_splits(splits_string)
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    # Rounding can over- or undershoot by a document; the last split absorbs the difference.
    shift = bounds[-1] - num_documents
    bounds = [max(b - shift, 0) if i > 0 else 0 for i, b in enumerate(bounds)]
    bounds = [min(b, num_documents) for b in bounds]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}


def build_sample_index(
    unit_lengths: np.ndarray, first_unit: int, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three index arrays for `num_samples` windows of seq_length + 1 tokens.

    The split's units are the consecutive sequences first_unit, first_unit + 1, ... of the indexed dataset,
    and `unit_lengths` their token counts.
    """
    tokens_per_epoch = int(unit_lengths.sum())
    if tokens_per_epoch == 0:
        raise ValueError("the data split holds no tokens; check model.data.data_prefix and splits_string")
    # Sample i covers global tokens [i*seq_length, i*seq_length + seq_length]; the last sample's final token
    # must exist, hence epochs * tokens_per_epoch - 1 >= num_samples * seq_length.
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))

    rng = np.random.default_rng([seed, 0])
    epochs = [rng.permutation(len(unit_lengths)) for _ in range(num_epochs)]
    local = np.concatenate(epochs).astype(np.int64)  # positions within the split
    doc_idx = local + int(first_unit)

    # Locate every sample's first token: the document holding global position p is the first whose running
    # token total exceeds p (side="right" also steps over empty documents).
    ordered_lengths = unit_lengths.astype(np.int64)[local]
    ends = np.cumsum(ordered_lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_position = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[doc_position] - ordered_lengths[doc_position])
    sample_idx = np.stack([doc_position, offsets], axis=1).astype(np.int64)

    shuffle_idx = np.random.default_rng([seed, 1]).permutation(num_samples).astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset:
    """`num_samples` token windows (np.int64, length seq_length + 1) from one split of one indexed dataset."""

    def __init__(
        self,
        indexed: IndexedDataset,
        split: str,
        document_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | os.PathLike | None = None,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
    ):
        self.indexed, self.split = indexed, split
        self.num_samples, self.seq_length = int(num_samples), int(seq_length)
        first_doc, stop_doc = document_range
        if stop_doc <= first_doc:
            raise ValueError(
                f"the {split} split of {indexed.prefix} has no documents; adjust model.data.splits_string"
            )
        first_unit = int(indexed.document_indices[first_doc])
        stop_unit = int(indexed.document_indices[stop_doc])
        params = {
            "format": _INDEX_FORMAT,
            "prefix": os.path.abspath(indexed.prefix),
            "idx_bytes": os.path.getsize(indexed.prefix + ".idx"),
            "idx_mtime_ns": os.stat(indexed.prefix + ".idx").st_mtime_ns,
            "split": split,
            "documents": [int(first_doc), int(stop_doc)],
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": int(seed),
        }
        key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
        directory = Path(cache_dir) if cache_dir else Path(indexed.prefix).parent
        stem = directory / f"{Path(indexed.prefix).name}_{split}_{key}"
        self.cache_paths = {name: Path(f"{stem}_{name}.npy") for name in ("doc_idx", "sample_idx", "shuffle_idx")}

        def build() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            lengths = indexed.sizes[first_unit:stop_unit]
            return build_sample_index(lengths, first_unit, self.num_samples, self.seq_length, int(seed))

        if is_builder and not all(p.is_file() for p in self.cache_paths.values()):
            arrays = build()
            _save_atomically(directory, self.cache_paths, arrays, stem.with_suffix(".json"), params)
        if barrier is not None:
            barrier()  # the builders' files are complete (renamed into place) before anyone reads them
        if all(p.is_file() for p in self.cache_paths.values()):
            self.doc_idx, self.sample_idx, self.shuffle_idx = (
                np.load(self.cache_paths[n], mmap_mode="r") for n in ("doc_idx", "sample_idx", "shuffle_idx")
            )
        else:
            # A rank that did not build and sees no cache (a node-local directory): compute in memory.
            self.doc_idx, self.sample_idx, self.shuffle_idx = build()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside the {self.split} split's {self.num_samples} samples")
        sample = int(self.shuffle_idx[index])
        doc_position, offset = (int(v) for v in self.sample_idx[sample])
        needed = self.seq_length + 1
        pieces = []
        # Walk forward through doc_idx until the window is full; it may span several documents.
        while needed > 0:
            unit = int(self.doc_idx[doc_position])
            take = min(int(self.indexed.sizes[unit]) - offset, needed)
            if take > 0:
                pieces.append(self.indexed.get(unit, offset, take))
                needed -= take
            doc_position, offset = doc_position + 1, 0
        return np.concatenate(pieces).astype(np.int64)

    def locate(self, index: int, position: int) -> tuple[str, int, int]:
        """Where token `position` of sample `index` lies on disk: (prefix, sequence in the .idx, token offset)."""
        doc_position, offset = (int(v) for v in self.sample_idx[int(self.shuffle_idx[index])])
        while True:  # the same walk as __getitem__
            unit = int(self.doc_idx[doc_position])
            take = int(self.indexed.sizes[unit]) - offset
            if position < take:
                return self.indexed.prefix, unit, offset + position
            position -= max(take, 0)
            doc_position, offset = doc_position + 1, 0


def _save_atomically(directory: Path, paths: dict[str, Path], arrays, description: Path, params: dict) -> None:
    """Write each array to a private temporary name and rename it into place.

    os.replace is atomic, so a rank that finds a file finds it whole, and two nodes that build the same
    (deterministic) index into a shared directory at once simply replace identical files.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp.{os.getpid()}.{os.uname().nodename}"
        for path, array in zip(paths.values(), arrays):
            temporary = path.with_name(path.name + suffix)
            with open(temporary, "wb") as f:
                np.save(f, array)
            os.replace(temporary, path)
        temporary = description.with_name(description.name + suffix)
        temporary.write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, description)
    except OSError as error:
        raise ValueError(
            f"cannot write the sample index cache in {directory} ({error.strerror}); "
            f"set model.data.index_mapping_dir to a writable directory"
        ) from error
