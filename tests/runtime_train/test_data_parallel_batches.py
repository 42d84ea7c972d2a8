# Data-parallel sharding: the ranks' micro-batches together are exactly the one-rank global batch, in order.
import numpy as np
import pytest
import torch

from runtime.data import DataParallelBatches, build_split_dataset


@pytest.fixture
def dataset(tmp_path, mmidx_writer):
    rng = np.random.default_rng(0)
    prefix = mmidx_writer(tmp_path / "c", [rng.integers(0, 500, size=int(n)) for n in rng.integers(5, 40, 60)])
    return build_split_dataset(prefix, "1,0,0", "train", 64, 12, seed=9)


@pytest.mark.parametrize("dp_size, micro", [(2, 2), (4, 1), (2, 4)])
def test_dp_ranks_partition_the_global_batch(dataset, dp_size, micro):
    single = DataParallelBatches(dataset, global_batch_size=8, micro_batch_size=micro)
    ranks = [DataParallelBatches(dataset, 8, micro, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(3):
        reference = torch.cat([batch.input_ids for batch in single.next_batch()])
        batches = [r.next_batch() for r in ranks]
        assert all(len(b) == 8 // (micro * dp_size) for b in batches)
        sharded = torch.cat([batch.input_ids for b in batches for batch in b])
        assert torch.equal(reference, sharded)
    assert single.consumed_samples == 24 and all(r.consumed_samples == 24 for r in ranks)


def test_labels_are_inputs_shifted_by_one(dataset):
    batch, *_ = DataParallelBatches(dataset, 4, 4).next_batch()
    ids, labels, mask = batch.input_ids, batch.labels, batch.loss_mask
    assert mask is None and batch.position_ids is None and batch.pair_ids is None
    assert ids.shape == labels.shape == (4, 12) and ids.dtype == torch.int64
    sample = torch.from_numpy(dataset[0])
    assert torch.equal(ids[0], sample[:-1]) and torch.equal(labels[0], sample[1:])


def test_position_is_state(dataset):
    batches = DataParallelBatches(dataset, 8, 2)
    batches.next_batch()
    state = batches.state_dict()
    expected = batches.next_batch()
    resumed = DataParallelBatches(dataset, 8, 2)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, resumed.next_batch()))


def test_indivisible_batch_sizes_are_refused(dataset):
    with pytest.raises(ValueError, match="global_batch_size: 8 is not divisible by micro_batch_size × data-parallel size = 3 × 1 = 3"):
        DataParallelBatches(dataset, 8, 3, dp_rank=0, dp_size=1)
    with pytest.raises(IndexError, match="runs past"):
        DataParallelBatches(dataset, 8, 2, consumed_samples=60).next_batch()
