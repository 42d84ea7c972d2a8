"""runtime/titan/data.py in process: for the same seed and layout torchtitan's batches are our runtime's samples in
our runtime's order (each dp rank its contiguous share of each global batch), every sample one causal block, and
the data position is {"consumed_samples": int} that a resume continues from."""
import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is the optional extra nxdt-launch[torchtitan]")

from runtime.data.loader import DataParallelBatches, build_split_dataset
from runtime.titan.data import MegatronDataLoader
from tests.titan.conftest import SEQ_LEN

GLOBAL_BATCH, LOCAL_BATCH, STEPS, SEED, SPLITS = 8, 2, 3, 1234, "98,1,1"


def titan_loader(corpus, dp_rank: int, dp_size: int) -> MegatronDataLoader:
    config = MegatronDataLoader.Config(blend=[tuple(entry) for entry in corpus], seed=SEED, splits_string=SPLITS,
                                       global_batch_size=GLOBAL_BATCH, steps=STEPS)
    return config.build(dp_world_size=dp_size, dp_rank=dp_rank, tokenizer=None, seq_len=SEQ_LEN,
                        local_batch_size=LOCAL_BATCH, snapshot_every_n_steps=None)


def runtime_samples(corpus) -> np.ndarray:
    """Our runtime's train samples as runtime/data/training.py builds them (max_steps * global_batch_size of the
    train split of model.data.data_prefix), read by one data-parallel rank: (steps, global_batch, seq_len + 1)."""
    data_prefix = [part for weight, prefix in corpus for part in (weight, prefix)]
    dataset = build_split_dataset(data_prefix=data_prefix, splits_string=SPLITS, split="train",
                                  num_samples=STEPS * GLOBAL_BATCH, seq_length=SEQ_LEN, seed=SEED)
    batches = DataParallelBatches(dataset, GLOBAL_BATCH, GLOBAL_BATCH)
    steps = []
    for _ in range(STEPS):
        (micro_batch,) = batches.next_batch()
        steps.append(torch.cat([micro_batch.input_ids, micro_batch.labels[:, -1:]], dim=1).numpy())
    return np.stack(steps)


def titan_steps(loader: MegatronDataLoader, dp_size: int) -> list[list[tuple[dict, torch.Tensor]]]:
    """The loader's batches grouped as torchtitan's Trainer takes them: global / (local * dp) per step."""
    per_step = GLOBAL_BATCH // (LOCAL_BATCH * dp_size)
    batches = list(loader)
    assert len(batches) == STEPS * per_step
    return [batches[i * per_step:(i + 1) * per_step] for i in range(STEPS)]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_torchtitan_reads_our_runtimes_samples_in_our_order(corpus, dp_size):
    expected = runtime_samples(corpus)
    per_rank = GLOBAL_BATCH // dp_size
    for rank in range(dp_size):
        for step, batches in enumerate(titan_steps(titan_loader(corpus, rank, dp_size), dp_size)):
            inputs = torch.cat([inputs["input"] for inputs, _ in batches]).numpy()
            labels = torch.cat([labels for _, labels in batches]).numpy()
            share = expected[step, rank * per_rank:(rank + 1) * per_rank]  # this rank's contiguous share
            np.testing.assert_array_equal(inputs, share[:, :-1])
            np.testing.assert_array_equal(labels, share[:, 1:])
            for inputs_dict, labels in batches:
                assert inputs_dict["input"].dtype == labels.dtype == torch.int64
                assert inputs_dict["input"].shape == labels.shape == (LOCAL_BATCH, SEQ_LEN)
                np.testing.assert_array_equal(inputs_dict["positions"],
                                              np.tile(np.arange(SEQ_LEN), (LOCAL_BATCH, 1)))


def test_the_data_position_is_consumed_samples_and_a_resume_continues_there(corpus):
    loader = titan_loader(corpus, 1, 2)
    iterator = iter(loader)
    for _ in range(GLOBAL_BATCH // (LOCAL_BATCH * 2)):  # one step's batches
        next(iterator)
    assert loader.state_dict() == {"consumed_samples": GLOBAL_BATCH}
    resumed = titan_loader(corpus, 1, 2)
    resumed.load_state_dict({"consumed_samples": GLOBAL_BATCH})
    for (expected, expected_labels), (got, got_labels) in zip(iterator, resumed):
        assert torch.equal(expected["input"], got["input"]) and torch.equal(expected_labels, got_labels)
    assert resumed.state_dict() == {"consumed_samples": STEPS * GLOBAL_BATCH}


def test_torchtitans_block_causal_mask_of_our_positions_is_plain_causal():
    """The masks torchtitan builds from positions (models/common/attention.py, ANDed as in its Decoder) allow
    exactly the causal triangle when positions run 0..L-1 in every row."""
    from torch.nn.attention.flex_attention import and_masks, create_mask
    from torchtitan.models.common.attention import (
        get_causal_mask_mod,
        get_document_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    for batch in (1, 3):  # torchtitan's packed-document mask has a batch-1 path and a batch-B one
        positions = torch.arange(SEQ_LEN).repeat(batch, 1)
        causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril().expand(batch, 1, SEQ_LEN, SEQ_LEN)
        for document_mod in (get_efficient_causal_mask_mod_for_packed_document(positions),
                             get_document_mask_mod(positions)):
            mask = create_mask(and_masks(get_causal_mask_mod(), document_mod), batch, None, SEQ_LEN, SEQ_LEN,
                               device="cpu")
            assert torch.equal(mask.bool(), causal)
