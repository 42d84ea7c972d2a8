# From config to the micro-batches one data-parallel rank trains on.
#
# A global batch is the `global_batch_size` consecutive samples starting at `consumed_samples`, identical for
# every layout. Data-parallel rank r takes the r-th contiguous slice of it (global_batch_size / dp samples) and
# cuts that into micro-batches, so the union over ranks is exactly what the single-process run reads at the
# same step. The position (`consumed_samples`) is the only state, and it is part of a checkpoint.
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import torch

from runtime.data.blend import BlendedDataset, blend_index
from runtime.micro_batch import MicroBatch
from runtime.schema import rules
from runtime.schema.data_prefix import parse_data_prefix
from runtime.data.gpt_dataset import GPTDataset, split_document_ranges
from runtime.data.indexed import IndexedDataset


def build_split_dataset(
    data_prefix,
    splits_string: str,
    split: str,
    num_samples: int,
    seq_length: int,
    seed: int,
    index_mapping_dir: str | os.PathLike | None = None,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
) -> BlendedDataset:
    """`num_samples` samples of one split ('train', 'valid' or 'test') of the (possibly blended) data."""
    entries = parse_data_prefix(data_prefix)
    dataset_index, dataset_sample_index = blend_index([e.weight for e in entries], num_samples)
    # Each dataset only needs as many samples as the mix draws from it.
    needed = np.bincount(dataset_index, minlength=len(entries))
    datasets = []
    for entry, count in zip(entries, needed):
        indexed = IndexedDataset(entry.prefix)
        document_range = split_document_ranges(indexed.num_documents, splits_string)[split]
        datasets.append(
            GPTDataset(
                indexed,
                split,
                document_range,
                max(int(count), 1),
                seq_length,
                seed,
                cache_dir=index_mapping_dir,
                is_builder=is_builder,
                barrier=barrier,
            )
        )
    return BlendedDataset(datasets, dataset_index, dataset_sample_index)


def _check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int) -> None:
    if problem := rules.global_batch(global_batch_size, micro_batch_size, dp_size, "training."):
        raise ValueError(problem)


def end_of_document(data, tokenizer_path: str) -> int | None:
    """The token that ends a pretraining document where model.data.reset_* separate them (`data`: the schema's
    DataConfig), else None; the one line the schema gives where the tokenizer has none (it said so at launch where
    it could look)."""
    if data is None or not data.reset_documents:
        return None
    from runtime.schema.chat import end_of_document_id
    from runtime.schema.rules import document_reset_eod

    eod = end_of_document_id(tokenizer_path)
    if problem := document_reset_eod(eod, tokenizer_path, "training."):
        raise ValueError(problem)
    return eod


def document_positions(inputs: torch.Tensor, end_of_document: int) -> torch.Tensor:
    """(B, T) positions that restart at 0 after every end-of-document token (Megatron's reset_position_ids: the
    token itself ends its document), as int64."""
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.long)
    starts[:, 1:] = (inputs[:, :-1] == end_of_document).long() * index[:, 1:]  # where a new document begins
    return index - starts.cummax(dim=1).values


class DataParallelBatches:
    """This rank's micro-batches of successive global batches, and the position within the dataset."""

    def __init__(
        self,
        dataset: Sequence,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        columns: torch.Tensor | None = None,
        end_of_document: int | None = None,
        vocab_size: int | None = None,
    ):
        _check_batch_sizes(global_batch_size, micro_batch_size, dp_size)
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        # Under a context group (long context), the positions of each sample this rank keeps
        # (runtime/parallel/context.py: sequence_index); the other ranks of the group read the same samples.
        self.columns = columns
        # model.data.reset_position_ids / reset_attention_mask: the token that ends a document; each pretraining
        # row then carries position_ids restarting after it, which also stops attention there (runtime/micro_batch.py).
        self.end_of_document = end_of_document
        # Pretraining token ids come from .bin files, not from the tokenizer: each batch is checked against the
        # model's vocabulary on the host (one max over it), so a damaged file or another tokenizer's data is named
        # here instead of failing as an index error inside the embedding on the device.
        self.vocab_size = vocab_size

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def rank_sample_indices(self, batch_start: int) -> np.ndarray:
        """Dataset indices this rank reads from the global batch that starts at sample `batch_start`."""
        per_rank = self.global_batch_size // self.dp_size
        first = batch_start + self.dp_rank * per_rank
        return np.arange(first, first + per_rank)

    def batch_at(self, batch_start: int) -> list[MicroBatch]:
        """The micro-batches of the global batch at `batch_start`: ids and labels (micro_batch_size, seq_length)
        int64.

        Pretraining has no loss_mask (every token counts): samples run across document boundaries, as in
        Megatron's default GPT pretraining, so there is no padding to mask. Fine-tuning rows (runtime/sft) add
        loss_mask and position_ids: loss on assistant tokens only, packed examples. Preference pairs
        (runtime/alignment) add loss_mask and pair_ids, with micro_batch_size pairs as twice as many rows.
        """
        if batch_start + self.global_batch_size > len(self.dataset):
            raise IndexError(
                f"global batch at sample {batch_start} runs past the {len(self.dataset)} samples built "
                f"for this split"
            )
        samples = np.stack([self.dataset[int(i)] for i in self.rank_sample_indices(batch_start)])
        if samples.ndim == 4:  # preference pairs (runtime/alignment): (N, 2, 4, seq_length), chosen and rejected
            pairs = torch.from_numpy(samples.astype(np.int64, copy=False))
            out = []
            for part in pairs.split(self.micro_batch_size):
                rows = torch.cat([part[:, 0], part[:, 1]])  # one forward batch: the chosen rows, then the rejected
                out.append(MicroBatch(rows[:, 0].contiguous(), rows[:, 1].contiguous(), rows[:, 2].float(),
                                      pair_ids=part[:, 0, 3, 0].contiguous()))
            return out
        if samples.ndim == 3:  # fine-tuning rows (runtime/sft): (N, 4, seq_length), already shifted and masked
            rows = torch.from_numpy(samples.astype(np.int64, copy=False))
            fields = [rows[:, k].contiguous() for k in range(4)]  # input_ids, labels, loss_mask, position_ids
            fields[2] = fields[2].float()
            return [MicroBatch(*parts) for parts in zip(*(f.split(self.micro_batch_size) for f in fields))]
        if self.vocab_size is not None:
            self._check_token_ids(samples, batch_start)
        tokens = torch.from_numpy(samples)  # (global_batch_size / dp, seq_length + 1)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # Documents are found in the whole row; under a context group the rank keeps its tokens and the whole row's
        # positions (runtime/micro_batch.py), from which its attention knows which keys share a query's document.
        positions = None if self.end_of_document is None else document_positions(inputs.long(), self.end_of_document)
        if self.columns is not None:
            inputs, labels = inputs[:, self.columns], labels[:, self.columns]
        if positions is not None:
            return [MicroBatch(i.contiguous(), l.contiguous(), position_ids=n) for i, l, n in
                    zip(inputs.split(self.micro_batch_size), labels.split(self.micro_batch_size),
                        positions.split(self.micro_batch_size))]
        return [MicroBatch(i.contiguous(), l.contiguous())
                for i, l in zip(inputs.split(self.micro_batch_size), labels.split(self.micro_batch_size))]

    def _check_token_ids(self, samples: np.ndarray, batch_start: int) -> None:
        """ValueError naming the file and position of the first token id outside [0, vocab_size) in `samples`."""
        if samples.size == 0 or (0 <= samples.min() and samples.max() < self.vocab_size):
            return
        row, position = (int(v) for v in np.argwhere((samples < 0) | (samples >= self.vocab_size))[0])
        index = int(self.rank_sample_indices(batch_start)[row])
        prefix, sequence, offset = self.dataset.locate(index, position)
        raise ValueError(f"model.data.data_prefix: {prefix}.bin holds token id {int(samples[row, position])} at "
                         f"sequence {sequence}, token {offset}, but the model's vocabulary has {self.vocab_size} "
                         f"ids; the file is damaged or was made with another tokenizer than model.tokenizer.model: "
                         f"prepare the data again with this tokenizer")

    def next_batch(self) -> list[MicroBatch]:
        batch = self.batch_at(self.consumed_samples)
        self.consumed_samples += self.global_batch_size
        return batch

    # The checkpoint issue saves and restores this with the model and optimizer.
    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
