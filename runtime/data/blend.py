# Mixing several token datasets by weight: parsing model.data.data_prefix (a [w1, p1, w2, p2, ...] list or the
# path of a blend file) and interleaving their samples so that every prefix of the mix respects the weights.
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class BlendEntry:
    weight: float
    prefix: str


def _check_weight(value, where: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: weight {value!r} is not a number") from None
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{where}: weight {value!r} must be a number >= 0")
    return weight


def _drop_zero_weights(entries: list[BlendEntry], source: str) -> list[BlendEntry]:
    """A weight of 0 (an empty shard in a token-count blend) contributes nothing; at least one must remain."""
    kept = [e for e in entries if e.weight > 0]
    if not kept:
        raise ValueError(f"model.data.data_prefix {source}: every weight is 0, so there is nothing to train on")
    return kept


def read_blend_file(path: str | os.PathLike) -> list[BlendEntry]:
    """Parse a Megatron-DeepSpeed DATA_FILE_LIST file: `weight prefix [corpus]` per line, `#` comments.

    A relative prefix is resolved against the blend file's own directory, so a data directory can be moved
    or mounted elsewhere as a whole.
    """
    path = Path(path)
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"model.data.data_prefix blend file {path} line {number}"
        if len(fields) not in (2, 3):
            raise ValueError(f"{where}: {raw.strip()!r} is not 'weight prefix [corpus]'")
        prefix = fields[1] if os.path.isabs(fields[1]) else str(path.parent / fields[1])
        entries.append(BlendEntry(_check_weight(fields[0], where), prefix))
    if not entries:
        raise ValueError(f"model.data.data_prefix blend file {path} lists no datasets")
    return _drop_zero_weights(entries, f"blend file {path}")


def parse_data_prefix(data_prefix) -> list[BlendEntry]:
    """model.data.data_prefix -> weighted prefixes. Accepts [w1, p1, ...], [p1], a blend file or one prefix."""
    if isinstance(data_prefix, (str, os.PathLike)):
        path = Path(data_prefix)
        if path.is_file() and path.suffix not in (".bin", ".idx"):
            return read_blend_file(path)
        if Path(f"{data_prefix}.idx").is_file():
            return [BlendEntry(1.0, str(data_prefix))]
        raise ValueError(
            f"model.data.data_prefix {str(data_prefix)!r} is neither a blend file nor a dataset prefix "
            f"(no {data_prefix}.idx)"
        )
    if isinstance(data_prefix, Sequence) and len(data_prefix) == 1 and isinstance(data_prefix[0], str):
        return [BlendEntry(1.0, data_prefix[0])]
    if not isinstance(data_prefix, Sequence) or not data_prefix or len(data_prefix) % 2:
        raise ValueError(
            f"model.data.data_prefix {data_prefix!r} is invalid; expected [weight1, prefix1, weight2, prefix2, ...] "
            f"or the path of a blend file"
        )
    entries = []
    for i in range(0, len(data_prefix), 2):
        weight, prefix = data_prefix[i], data_prefix[i + 1]
        if not isinstance(prefix, str):
            raise ValueError(f"model.data.data_prefix[{i + 1}] {prefix!r} is not a dataset prefix (a path)")
        entries.append(BlendEntry(_check_weight(weight, f"model.data.data_prefix[{i}]"), prefix))
    return _drop_zero_weights(entries, "list")


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset it comes from and which sample of that dataset.

    Dataset d's k-th sample is placed at "time" (k + 0.5) / w_d (weights normalized); merging those times gives
    an interleaving in which after n samples dataset d has contributed n * w_d of them to within about one sample,
    the same guarantee as Megatron's greedy error-minimizing loop, without a Python loop per sample.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    times, owners, ranks = [], [], []
    for d, weight in enumerate(w):
        count = int(math.ceil(weight * num_samples)) + 2
        k = np.arange(count, dtype=np.int64)
        times.append((k + 0.5) / weight)
        owners.append(np.full(count, d, dtype=np.int64))
        ranks.append(k)
    times, owners, ranks = np.concatenate(times), np.concatenate(owners), np.concatenate(ranks)
    order = np.lexsort((owners, times))[:num_samples]  # ties go to the earlier dataset
    return owners[order], ranks[order]


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights, deterministically."""

    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]
