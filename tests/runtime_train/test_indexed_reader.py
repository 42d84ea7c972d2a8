# The MMIDIDX reader against the test's own writer: every dtype, document boundaries, partial reads, bad files.
import numpy as np
import pytest

from runtime.data import DTYPE_CODES, IndexedDataset


@pytest.mark.parametrize("dtype", sorted(set(DTYPE_CODES.values()), key=lambda t: np.dtype(t).str))
def test_round_trip_every_dtype(tmp_path, mmidx_writer, dtype):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 17, 1, 64)]
    prefix = mmidx_writer(tmp_path / "d", sequences, dtype=dtype, document_indices=[0, 2, 5])
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 5 and ds.num_documents == 2
    assert ds.sizes.tolist() == [5, 0, 17, 1, 64]
    assert list(ds.document_sequences(1)) == [2, 3, 4]
    for i, expected in enumerate(sequences):
        np.testing.assert_array_equal(ds[i], expected)
    np.testing.assert_array_equal(ds.get(2, offset=3, length=4), sequences[2][3:7])
    np.testing.assert_array_equal(ds.get(4, offset=60), sequences[4][60:])


def test_partial_read_outside_sequence_is_refused(tmp_path, mmidx_writer):
    ds = IndexedDataset(mmidx_writer(tmp_path / "d", [[1, 2, 3]]))
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_bad_files_name_the_problem(tmp_path, mmidx_writer):
    with pytest.raises(ValueError, match="does not exist"):
        IndexedDataset(tmp_path / "missing")
    prefix = mmidx_writer(tmp_path / "d", [[1, 2, 3]])
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[17] = 42  # the dtype code byte, right after magic (9) and version (8)
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="dtype code 42"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(b"NOTANIDX" + bytes(raw[8:]))
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(prefix)
