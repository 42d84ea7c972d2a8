# Mixing several token datasets by weight: interleaving their samples so that every prefix of the mix respects
# the weights. model.data.data_prefix itself is parsed by runtime/schema/data_prefix.py.
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


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

    def locate(self, index: int, position: int) -> tuple[str, int, int]:
        """(prefix, sequence, token offset) of token `position` of blended sample `index` (GPTDataset.locate)."""
        return self.datasets[int(self.dataset_index[index])].locate(int(self.dataset_sample_index[index]), position)
