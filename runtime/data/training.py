"""The training stages' batches, built from their config: indexed documents for pretraining, packed chat rows for
fine-tuning, preference pairs for alignment; each as train batches sized for max_steps and fixed validation batches.
runtime/train.py builds them once, after the model and its optimizer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.data.loader import DataParallelBatches, build_split_dataset, end_of_document
from runtime.parallel.context import sequence_index

if TYPE_CHECKING:
    from runtime.config import TrainingConfig
    from runtime.device import Device
    from runtime.parallel import Topology


def build_data(
    cfg: TrainingConfig, topo: Topology, device: Device
) -> tuple[DataParallelBatches, DataParallelBatches | None]:
    """Train batches sized for max_steps, and the fixed validation batches (the same ones at every check)."""
    if cfg.alignment is not None or cfg.reward_model is not None:
        return build_preference_data(cfg, topo, device)
    if cfg.sft is not None:
        return build_sft_data(cfg, topo, device)
    data, trainer = cfg.data, cfg.trainer
    common = dict(
        data_prefix=data.data_prefix,
        splits_string=data.splits_string,
        seq_length=data.seq_length,
        seed=cfg.seed,
        index_mapping_dir=data.index_mapping_dir,
        # One builder per node: the index directory may be node-local; on a shared one the writes are atomic.
        is_builder=device.local_rank == 0,
        barrier=device.barrier,
    )
    train_set = build_split_dataset(split="train", num_samples=trainer.max_steps * data.global_batch_size, **common)
    columns = None
    if topo.cp.size > 1:  # long context: this rank's tokens of every sample its context group reads
        columns = sequence_index(data.seq_length, topo.cp.rank, topo.cp.size, cfg.parallel.context_kind)
    eod = end_of_document(data, cfg.tokenizer_path)
    batches = dict(global_batch_size=data.global_batch_size, micro_batch_size=data.micro_batch_size,
                   dp_rank=topo.data_rank, dp_size=topo.data_size, columns=columns, end_of_document=eod,
                   vocab_size=cfg.model.vocab_size)
    train = DataParallelBatches(train_set, **batches)
    valid = None
    if trainer.val_check_interval > 0 and trainer.limit_val_batches > 0:
        valid_set = build_split_dataset(
            split="valid", num_samples=trainer.limit_val_batches * data.global_batch_size, **common
        )
        valid = DataParallelBatches(valid_set, **batches)
    return train, valid


def build_sft_data(cfg: TrainingConfig, topo: Topology, device: Device
                   ) -> tuple[DataParallelBatches, DataParallelBatches | None]:
    """Fine-tuning: chat records tokenized once (cached beside the data), packed into rows, read in epochs."""
    from functools import partial

    from runtime.sft.dataset import build_sft_dataset

    sft, data = cfg.sft, cfg.data
    build = partial(build_sft_dataset, tokenizer_path=cfg.tokenizer_path, seq_length=data.seq_length,
                    chat_template=sft.chat_template, packing=sft.packing, truncation=sft.truncation,
                    **_cache_args(cfg, device))

    def describe(stats: dict) -> str:
        return (f"fine-tuning data: {stats.get('examples')} examples in {stats.get('rows')} rows of "
                f"{data.seq_length} tokens ({'packed' if sft.packing else 'one per row'}; padding "
                f"{stats.get('padding_fraction', 0):.1%}, truncated {stats.get('truncated', 0)}, dropped "
                f"{stats.get('dropped', 0)})")

    return _record_epochs(cfg, topo, device, build, describe)


def build_preference_data(cfg: TrainingConfig, topo: Topology, device: Device
                          ) -> tuple[DataParallelBatches, DataParallelBatches | None]:
    """Alignment and the reward model (rlhf_rm): preference pairs tokenized once (cached beside the data), read in
    epochs; a sample is a pair."""
    from functools import partial

    from runtime.alignment.data import build_preference_dataset

    pairs = cfg.alignment or cfg.reward_model  # how each pair is cut (the same keys in both)
    build = partial(build_preference_dataset, tokenizer_path=cfg.tokenizer_path, seq_length=cfg.data.seq_length,
                    chat_template=cfg.sft.chat_template, max_prompt_length=pairs.max_prompt_length,
                    truncation_mode=pairs.truncation_mode, limit_key=pairs.limit_key,
                    identical_pairs=cfg.sft.identical_pairs, **_cache_args(cfg, device))

    alignment = cfg.alignment
    trains = "a reward model" if alignment is None else f"{alignment.strategy} with beta {alignment.beta}"

    def describe(stats: dict) -> str:
        return (f"preference data: {stats.get('kept')} of {stats.get('pairs')} pairs (truncated "
                f"{stats.get('truncated', 0)}, dropped {stats.get('dropped', 0)}), {trains}")

    return _record_epochs(cfg, topo, device, build, describe)


def _cache_args(cfg: TrainingConfig, device: Device) -> dict:
    """Tokenized once per node, by local rank 0, into the cache beside the data (or index_mapping_dir)."""
    return dict(cache_dir=cfg.data.index_mapping_dir, num_workers=max(cfg.data.num_workers, 1),
                is_builder=device.local_rank == 0, barrier=device.barrier)


def _record_epochs(cfg: TrainingConfig, topo: Topology, device: Device, build, describe
                   ) -> tuple[DataParallelBatches, DataParallelBatches | None]:
    """The train files' samples (build(files)) read in seeded epochs for max_steps, and the validation files'
    (the same samples at every check, in file order when they suffice)."""
    from runtime.sft.dataset import epoch_samples

    sft, data, trainer = cfg.sft, cfg.data, cfg.trainer
    batches = dict(global_batch_size=data.global_batch_size, micro_batch_size=data.micro_batch_size,
                   dp_rank=topo.data_rank, dp_size=topo.data_size)
    rows = build(list(sft.train_files))
    if device.is_main:
        print(describe(rows.stats), flush=True)
    train = DataParallelBatches(epoch_samples(rows, trainer.max_steps * data.global_batch_size, cfg.seed), **batches)
    valid = None
    if sft.validation_files and trainer.val_check_interval > 0 and trainer.limit_val_batches > 0:
        valid_rows = build(list(sft.validation_files))
        valid = DataParallelBatches(epoch_samples(valid_rows, trainer.limit_val_batches * data.global_batch_size,
                                                  cfg.seed), **batches)
    return train, valid
