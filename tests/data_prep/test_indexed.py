"""The writer against the independent reader in conftest.py, and the header bytes against the spec."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from runtime.data_prep.indexed import IndexedDatasetWriter, token_dtype
from tests.data_prep.conftest import read_indexed


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5), (np.uint8, 1)])
def test_round_trip(tmp_path, dtype, code):
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 100_000)
    docs = [rng.integers(0, high, size=int(n), dtype=np.int64) for n in rng.integers(1, 300, size=57)]
    prefix = tmp_path / "d"
    writer = IndexedDatasetWriter(f"{prefix}.bin", f"{prefix}.idx", np.dtype(dtype))
    writer.add_document(docs[0])
    flat = np.concatenate(docs[1:30])
    writer.add_documents(flat, np.array([d.size for d in docs[1:30]], dtype=np.int32))
    for doc in docs[30:]:
        writer.add_document(doc)
    bin_bytes, idx_bytes = writer.finish()
    got_dtype, got = read_indexed(prefix)
    assert got_dtype == np.dtype(dtype)
    assert len(got) == len(docs)
    for want, have in zip(docs, got):
        np.testing.assert_array_equal(have.astype(np.int64), want)
    idx = (tmp_path / "d.idx").read_bytes()
    assert idx_bytes == len(idx) == 34 + len(docs) * (4 + 8 + 8) + 8
    assert bin_bytes == sum(d.size for d in docs) * np.dtype(dtype).itemsize
    # Header, field by field: magic, version, dtype code, sequence count, document-index length (docs + 1).
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", idx[9:34]) == (1, code, len(docs), len(docs) + 1)
    pointers = np.frombuffer(idx, "<i8", len(docs), 34 + 4 * len(docs))
    assert pointers[0] == 0 and pointers[1] == docs[0].size * np.dtype(dtype).itemsize


def test_empty_dataset_is_well_formed(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "e.bin", tmp_path / "e.idx", np.dtype(np.uint16))
    writer.finish()
    assert read_indexed(tmp_path / "e") == (np.dtype(np.uint16), [])


def test_dtype_rule():
    assert token_dtype(4096) == np.uint16
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(128256) == np.int32
    assert token_dtype(1000, "int64") == np.int64
    with pytest.raises(ValueError, match="cannot hold token ids up to 99999"):
        token_dtype(100000, "uint16")
