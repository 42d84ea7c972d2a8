# torchtitan's dataloader over our data_preparation output: the Megatron .bin/.idx blend read through our runtime's
# own dataset code (runtime/data/loader.py), so that for the same seed, splits and batch sizes a torchtitan job
# trains on exactly the token sequences our runtime does, in the same order, each data-parallel rank taking the
# same contiguous share of every global batch.
#
# What torchtitan's Trainer asks of a dataloader (torchtitan/trainer.py, components/dataloader.py): a
# BaseDataLoader built with dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size and
# snapshot_every_n_steps; iterating it yields ({"input": (B, L) int64, "positions": (B, L) int64}, labels (B, L)
# int64), B = training.local_batch_size, one of gradient_accumulation_steps = global / (local * dp) such batches
# per step; state_dict()/load_state_dict() are saved under "dataloader" in its checkpoint.
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from runtime.data.loader import DataParallelBatches, build_split_dataset


class MegatronDataLoader(BaseDataLoader):
    """This data-parallel rank's micro-batches of successive global batches of the blend's train split.

    Every sample is one sequence of seq_len tokens with positions 0..seq_len-1: torchtitan's block-causal mask
    (documents start where positions are 0) is then one causal block, our runtime's plain causal mask over the
    packed sequence. The position is the only state: {"consumed_samples": global samples consumed} (NeMo's name),
    the same on every rank, as in a checkpoint of our runtime.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        blend: list[tuple[float, str]] = field(default_factory=list)
        """The data_preparation output: (weight, .bin/.idx prefix) pairs (model.data.data_prefix)."""

        seed: int = 1234
        """Shuffles documents and samples, as our runtime's seed does (training.seed there)."""

        splits_string: str = "969,30,1"
        """train,valid,test proportions of each dataset's documents; this loader reads the train split."""

        index_dir: str | None = None
        """Where the sample indices are cached (model.data.index_mapping_dir); None: beside the data."""

        global_batch_size: int = 1
        """Samples per optimizer step over all data-parallel ranks (training.global_batch_size)."""

        steps: int = 1
        """Steps the split is sized for (training.steps): the sample index, hence its shuffle, depends on it."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer | None,
                 seq_len: int, local_batch_size: int, **kwargs):
        if not config.blend:
            raise ValueError("dataloader.blend: no data; give (weight, prefix) pairs of prepared .bin/.idx data")
        data_prefix: str | list = [part for weight, prefix in config.blend for part in (weight, prefix)]
        if len(config.blend) == 1 and float(config.blend[0][0]) == 1.0:
            # One path: a prefix, or a blend file the launch could not read yet (its data_preparation writes it),
            # which our dataset reads as model.data.data_prefix reads either.
            data_prefix = str(config.blend[0][1])
        # Every rank builds the index it needs: the cache files are written atomically (runtime/data/gpt_dataset.py),
        # and no process group is needed for a barrier.
        dataset = build_split_dataset(data_prefix, config.splits_string, "train",
                                      num_samples=config.steps * config.global_batch_size, seq_length=seq_len,
                                      seed=config.seed, index_mapping_dir=config.index_dir)
        self.batches = DataParallelBatches(dataset, config.global_batch_size, local_batch_size,
                                           dp_rank=dp_rank, dp_size=dp_world_size)
        self.seq_len = seq_len

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        # Resumes at consumed_samples, which load_state_dict may have set before the Trainer iterates. Global
        # batches are read whole (the next only when torchtitan asks for its first micro-batch), so after a step
        # consumed_samples counts exactly the samples trained on.
        while self.batches.consumed_samples + self.batches.global_batch_size <= len(self.batches.dataset):
            for micro_batch in self.batches.next_batch():
                inputs = micro_batch.input_ids.long()
                positions = torch.arange(self.seq_len, dtype=torch.long).repeat(inputs.shape[0], 1)
                yield {"input": inputs, "positions": positions}, micro_batch.labels.long()

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:  # an empty dict: a checkpoint without the data position (e.g. model-only)
            self.batches.load_state_dict(state_dict)


class PretokenizedData(BaseTokenizer):
    """The Trainer builds a tokenizer from hf_assets_path before the dataloader; our data is token ids already
    (made by data_preparation with the recipe's tokenizer), so this one reads no files and encodes nothing."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | os.PathLike | None = None):
        super().__init__()
        self.vocab_size = config.vocab_size if config is not None else 0

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("the data is token ids already (data_preparation); there is no text to encode")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("no tokenizer files are read for pretokenized data")

    def get_vocab_size(self) -> int:
        return self.vocab_size
