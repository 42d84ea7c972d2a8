# Reference log-probabilities for DPO: the frozen starting model's summed response log-prob of every pair's chosen
# and rejected side, computed once before the first step and kept beside the data cache, so no second model is
# held in memory and a restart (preemption, kill -9) reads the same values instead of recomputing them.
#
# The table is computed with the parallelized model itself before any step (or any checkpoint is loaded), i.e.
# with the starting weights: every DP rank scores its share of the pairs (every rank the same number of
# micro-batches, so collectives that span DP, like expert all-to-alls, stay matched) and the shares are summed
# over DP. With LoRA and precompute_ref_log_probs false, `live_scorer` scores each step's own batches with the
# adapters switched off instead (the base model, which is where LoRA starts).
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.alignment.objective import sequence_log_probs
from runtime.device import compile_trial_run
from runtime.io.files import atomic_write_json, read_json, sha256_file, temp_name
from runtime.micro_batch import PreparedBatch
from runtime.models.lora import adapters_off
from runtime.parallel import collectives as C
from runtime.parallel.topology import Topology

_FORMAT = 1


@torch.no_grad()
def score_batch(model: nn.Module, batch: PreparedBatch, topo: Topology, autocast: Callable) -> torch.Tensor:
    """(rows,) summed response log-probs of one micro-batch, forward only, in eval mode; the same on every rank of
    the batch's TP and PP groups."""
    input_ids, labels, mask, layout = batch.input_ids, batch.labels, batch.loss_mask, batch.layout
    was_training = model.training
    model.eval()
    try:
        if topo.pp.size > 1:
            from runtime.parallel.pipeline import collect_pipeline

            def per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                flat = logits.float().flatten(0, -2)
                return F.cross_entropy(flat, labels.flatten(), reduction="none").view(labels.shape)

            with autocast():
                losses = collect_pipeline(model, [PreparedBatch(input_ids, labels, mask)], topo, per_token,
                                          lambda ids: tuple(ids.shape))[0]
        else:
            with autocast():
                losses = model(input_ids, labels, layout)
        return sequence_log_probs(losses.float(), mask)[0]
    finally:
        model.train(was_training)


def live_scorer(topo: Topology, autocast: Callable) -> Callable[[nn.Module, PreparedBatch], torch.Tensor]:
    """LoRA without precomputed references: the base model (adapters off) scores each batch as it comes."""
    def score(model: nn.Module, batch: PreparedBatch) -> torch.Tensor:
        with adapters_off(model):
            return score_batch(model, batch, topo, autocast)

    return score


def reference_table(model: nn.Module, dataset, topo: Topology, *, micro_batch_size: int, device: torch.device,
                    model_key: str, autocast: Callable, is_writer: bool, barrier: Callable[[], None],
                    describe: str = "train") -> torch.Tensor:
    """(pairs, 2) reference log-prob sums of `dataset` (runtime/alignment/data.py PreferenceDataset), on `device`:
    read from the cache beside the dataset's when it is there and intact, else computed and written (by
    is_writer). model_key names the starting weights (reference_key)."""
    if compile_trial_run():
        # The Neuron compile step (neuron_parallel_compile, whose tensors hold no real values): one micro-batch
        # compiles the scoring graph; nothing is cached, so the real run computes the real table.
        _compute(model, dataset, topo, micro_batch_size, device, autocast, limit=micro_batch_size * topo.data_size)
        return torch.zeros(len(dataset), 2, dtype=torch.float32, device=device)
    path = Path(dataset.cache_dir) / f"ref_{dataset.cache_key}_{model_key}.npy"
    table = _load(path, len(dataset))
    # Every rank must agree on whether to compute: one that found the file and one that did not would deadlock.
    missing = torch.tensor([1.0 if table is None else 0.0], device=device)
    if C.all_reduce_world(missing).item() == 0:
        return torch.from_numpy(table).to(device)
    table = _compute(model, dataset, topo, micro_batch_size, device, autocast)
    if is_writer:
        _save(path, table.cpu().numpy())
        print(f"reference log-probs: {len(dataset)} {describe} pairs scored by the starting model, cached in {path}",
              flush=True)
    barrier()
    return table


def reference_key(restore_from_path: str | None, model_cfg, seed: int, precision: str, lora: bool) -> str:
    """What the reference depends on besides the data: the starting weights (their path and, when local, each
    file's size and modification time), the model's shape, the seed of a random init and the precision."""
    weights: list = [restore_from_path, seed if restore_from_path is None else None]
    if restore_from_path and os.path.exists(restore_from_path):
        for root, _, names in sorted(os.walk(restore_from_path)):
            for name in sorted(names):
                stat = os.stat(os.path.join(root, name))
                weights.append((os.path.relpath(os.path.join(root, name), restore_from_path), stat.st_size,
                                stat.st_mtime_ns))
    params = {"format": _FORMAT, "weights": weights, "model": repr(model_cfg), "precision": precision, "lora": lora}
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _compute(model: nn.Module, dataset, topo: Topology, micro_batch_size: int, device: torch.device,
             autocast: Callable, limit: int | None = None) -> torch.Tensor:
    pairs = len(dataset) if limit is None else min(len(dataset), limit)
    per_rank = -(-pairs // (topo.data_size * micro_batch_size)) * micro_batch_size  # equal work on every DP rank
    table = torch.zeros(len(dataset), 2, dtype=torch.float32, device=device)
    first = topo.data_rank * per_rank
    for start in range(first, first + per_rank, micro_batch_size):
        indices = [i for i in range(start, start + micro_batch_size)]
        # Past the end: score pair 0 again and drop it, so every rank runs the same micro-batches.
        samples = torch.from_numpy(np.stack([dataset[i if i < pairs else 0] for i in indices]))
        both = torch.cat([samples[:, 0], samples[:, 1]]).to(device)  # chosen rows, then rejected rows
        batch = PreparedBatch(both[:, 0], both[:, 1], both[:, 2].float())
        logps = score_batch(model, batch, topo, autocast)
        m = len(indices)
        for row, index in enumerate(indices):
            if index < pairs:
                table[index, 0], table[index, 1] = logps[row], logps[m + row]
    # Each pair was scored by exactly one DP rank (and identically by its TP/PP peers): a sum over DP assembles it.
    C.all_reduce(table, topo.dp)
    return table


def _save(path: Path, table: np.ndarray) -> None:
    """The table, then its description with the checksum: a reader that finds the description finds it whole."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = temp_name(path)
        with open(temporary, "wb") as f:
            np.save(f, table)
        checksum = sha256_file(temporary)
        os.replace(temporary, path)
        atomic_write_json(path.with_suffix(".json"), {"sha256": checksum, "pairs": int(table.shape[0])})
    except OSError as err:
        raise ValueError(f"cannot write the reference log-probs in {path.parent} ({err.strerror or err}); set "
                         f"model.data.index_mapping_dir to a writable directory") from None


def _load(path: Path, pairs: int) -> np.ndarray | None:
    """The cached table; None when absent, or damaged (named on stderr: it is recomputed, never used)."""
    saved = read_json(path.with_suffix(".json"))
    if saved is None:
        return None
    problem = None
    if not path.is_file() or sha256_file(path) != saved.get("sha256"):
        problem = f"do not match their checksum in {path.with_suffix('.json').name}"
    elif saved.get("pairs") != pairs:
        problem = f"hold {saved.get('pairs')} pairs, not the data's {pairs}"
    if problem:
        print(f"warning: {path}: the reference log-probs {problem}; recomputing them", file=sys.stderr, flush=True)
        return None
    return np.load(path)
