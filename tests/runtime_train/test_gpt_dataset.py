# Sample indices: every window has seq_length + 1 tokens read in doc_idx order, the index is deterministic,
# cached and reused, splits are disjoint, and blends follow their weights.
import numpy as np
import pytest

import runtime.data.gpt_dataset as gpt_dataset
from runtime.data import (
    GPTDataset,
    IndexedDataset,
    blend_index,
    build_split_dataset,
    parse_data_prefix,
    split_document_ranges,
)


def _corpus(tmp_path, mmidx_writer, name="c", num_docs=40, base=0, seed=0):
    rng = np.random.default_rng(seed)
    docs = [base + rng.integers(0, 50, size=int(n)) for n in rng.integers(1, 30, size=num_docs)]
    return mmidx_writer(tmp_path / name, docs), docs


def test_split_ranges_cover_every_document():
    assert split_document_ranges(100, "98,1,1") == {"train": (0, 98), "valid": (98, 99), "test": (99, 100)}
    assert split_document_ranges(10, "8,2") == {"train": (0, 8), "valid": (8, 10), "test": (10, 10)}
    ranges = split_document_ranges(7, "1,1,1")
    assert ranges["train"][0] == 0 and ranges["test"][1] == 7
    assert ranges["train"][1] == ranges["valid"][0] and ranges["valid"][1] == ranges["test"][0]
    with pytest.raises(ValueError, match="splits_string: 'a,b' is invalid"):
        split_document_ranges(10, "a,b")


def test_samples_are_windows_over_doc_idx(tmp_path, mmidx_writer):
    prefix, docs = _corpus(tmp_path, mmidx_writer)
    ds = GPTDataset(IndexedDataset(prefix), "train", (0, 30), num_samples=50, seq_length=16, seed=3)
    stream = np.concatenate([docs[int(u)] for u in ds.doc_idx])  # the split's tokens in epoch order
    assert set(np.asarray(ds.doc_idx).tolist()) == set(range(30))  # only the train documents
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.shape == (17,) and sample.dtype == np.int64
        start = int(ds.shuffle_idx[i]) * 16
        np.testing.assert_array_equal(sample, stream[start : start + 17])


def test_index_is_deterministic_cached_and_reused(tmp_path, mmidx_writer, monkeypatch):
    prefix, _ = _corpus(tmp_path, mmidx_writer)
    first = GPTDataset(IndexedDataset(prefix), "train", (0, 30), 40, 8, seed=1, cache_dir=tmp_path / "idx")
    assert all(p.is_file() for p in first.cache_paths.values())
    assert all(p.parent == tmp_path / "idx" for p in first.cache_paths.values())

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("the cached index was rebuilt")

    monkeypatch.setattr(gpt_dataset, "build_sample_index", must_not_rebuild)
    again = GPTDataset(IndexedDataset(prefix), "train", (0, 30), 40, 8, seed=1, cache_dir=tmp_path / "idx")
    assert again.cache_paths == first.cache_paths
    assert all(np.array_equal(first[i], again[i]) for i in range(40))
    monkeypatch.undo()

    other_seed = GPTDataset(IndexedDataset(prefix), "train", (0, 30), 40, 8, seed=2, cache_dir=tmp_path / "idx")
    assert other_seed.cache_paths != first.cache_paths
    assert not all(np.array_equal(first[i], other_seed[i]) for i in range(40))
    # Default location: next to the data.
    beside = GPTDataset(IndexedDataset(prefix), "train", (0, 30), 40, 8, seed=1)
    assert all(p.parent == tmp_path for p in beside.cache_paths.values())


def test_a_rank_that_is_not_the_builder_waits_and_loads(tmp_path, mmidx_writer):
    prefix, _ = _corpus(tmp_path, mmidx_writer)
    calls = []
    built = GPTDataset(IndexedDataset(prefix), "valid", (30, 40), 10, 8, seed=0, barrier=lambda: calls.append(1))
    waiter = GPTDataset(
        IndexedDataset(prefix), "valid", (30, 40), 10, 8, seed=0, is_builder=False, barrier=lambda: calls.append(2)
    )
    assert calls == [1, 2]
    assert isinstance(waiter.sample_idx, np.memmap)  # loaded from the builder's files
    assert all(np.array_equal(built[i], waiter[i]) for i in range(10))


def test_empty_split_is_a_clear_error(tmp_path, mmidx_writer):
    prefix, _ = _corpus(tmp_path, mmidx_writer, num_docs=10)
    with pytest.raises(ValueError, match="valid split .* has no documents"):
        build_split_dataset(prefix, "100,0,0", "valid", 4, 8, seed=0)


def test_blend_index_follows_weights():
    owners, ranks = blend_index([0.5, 0.3, 0.2], 1000)
    counts = np.bincount(owners)
    np.testing.assert_allclose(counts / 1000, [0.5, 0.3, 0.2], atol=0.002)
    for d in range(3):  # each dataset's samples are taken in order, none skipped or repeated
        assert ranks[owners == d].tolist() == list(range(counts[d]))
    for n in (10, 57, 333):  # every prefix of the mix is balanced too
        np.testing.assert_allclose(np.bincount(owners[:n], minlength=3), np.array([0.5, 0.3, 0.2]) * n, atol=1.5)


def test_blended_split_draws_from_each_corpus_by_weight(tmp_path, mmidx_writer):
    a, _ = _corpus(tmp_path, mmidx_writer, "a", base=0)
    b, _ = _corpus(tmp_path, mmidx_writer, "b", base=1000, seed=1)
    ds = build_split_dataset([3, a, 1, b], "90,5,5", "train", 400, 8, seed=5)
    from_b = sum(int(ds[i][0] >= 1000) for i in range(len(ds)))
    assert abs(from_b / 400 - 0.25) < 0.01
    again = build_split_dataset([3, a, 1, b], "90,5,5", "train", 400, 8, seed=5)
    assert all(np.array_equal(ds[i], again[i]) for i in range(0, 400, 7))


def test_blend_file_and_data_prefix_forms(tmp_path, mmidx_writer):
    a, _ = _corpus(tmp_path, mmidx_writer, "a")
    (tmp_path / "sub").mkdir()
    mmidx_writer(tmp_path / "sub" / "b", [[1, 2, 3]])
    blend = tmp_path / "blend.txt"
    blend.write_text(f"# weight prefix corpus\n\n0.75 {a} news\n0.25 sub/b  # relative to this file\n")
    entries = parse_data_prefix(str(blend))
    assert [(e.weight, e.prefix) for e in entries] == [(0.75, a), (0.25, str(tmp_path / "sub" / "b"))]
    assert [e.weight for e in parse_data_prefix([1, a, 2.5, a])] == [1.0, 2.5]
    assert parse_data_prefix(a)[0].prefix == a
    with pytest.raises(ValueError, match=r"model.data.data_prefix\[2\]: weight 'x'"):
        parse_data_prefix([1, a, "x", a])
    with pytest.raises(ValueError, match="neither a blend file nor a dataset prefix"):
        parse_data_prefix(str(tmp_path / "nothing"))
    blend.write_text(f"0 {tmp_path}/empty_shard\n2 {a}\n")  # token-count blends give empty shards weight 0
    assert [(e.weight, e.prefix) for e in parse_data_prefix(str(blend))] == [(2.0, a)]
    blend.write_text(f"-1 {a}\n")
    with pytest.raises(ValueError, match="line 1: weight '-1' must be a number >= 0"):
        parse_data_prefix(str(blend))
    with pytest.raises(ValueError, match="every weight is 0"):
        parse_data_prefix([0, a])


def _build_in_child(prefix, cache_dir, queue):
    ds = GPTDataset(IndexedDataset(prefix), "train", (0, 40), 300, 8, seed=4, cache_dir=cache_dir)
    queue.put([ds[i].tolist() for i in range(0, 300, 37)])


def test_ranks_building_at_once_agree(tmp_path, mmidx_writer):
    """Several builders racing into one directory (nodes sharing a file system) leave one valid index."""
    import multiprocessing

    prefix, _ = _corpus(tmp_path, mmidx_writer)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    children = [context.Process(target=_build_in_child, args=(prefix, tmp_path / "shared", queue)) for _ in range(3)]
    for child in children:
        child.start()
    results = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert results[0] == results[1] == results[2]
    assert not list((tmp_path / "shared").glob("*.tmp.*"))  # no temporary file left behind
    after = GPTDataset(IndexedDataset(prefix), "train", (0, 40), 300, 8, seed=4, cache_dir=tmp_path / "shared")
    assert [after[i].tolist() for i in range(0, 300, 37)] == results[0]


def test_reads_what_data_preparation_writes(tmp_path):
    """Seam 3: runtime/data_prep's writer and this reader were written apart; they must agree."""
    from runtime.data_prep.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 60000, size=int(n)) for n in rng.integers(1, 90, size=25)]
    writer = IndexedDatasetWriter(tmp_path / "p.bin", tmp_path / "p.idx", np.dtype(np.uint16))
    for doc in docs:
        writer.add_document(doc)
    writer.finish()
    ds = IndexedDataset(tmp_path / "p")
    assert len(ds) == ds.num_documents == 25
    assert all(np.array_equal(ds[i], doc) for i, doc in enumerate(docs))
    (tmp_path / "blend.txt").write_text(f"{sum(map(len, docs))} {tmp_path / 'p'}\n")
    split = build_split_dataset(str(tmp_path / "blend.txt"), "1,0,0", "train", 20, 16, seed=0)
    assert all(split[i].shape == (17,) for i in range(20))
