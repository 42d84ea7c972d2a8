"""Writer for Megatron-LM's indexed dataset: token ids in `<prefix>.bin`, their layout in `<prefix>.idx`.

The layout (docs/data_format.md has the full table):

    .idx  b"MMIDIDX\\x00\\x00"  <Q version=1  <B dtype code  <Q sequence count S  <Q document index length D+1
          int32[S] sequence lengths (tokens)   int64[S] byte offsets into .bin   int64[D+1] document index
    .bin  the sequences' tokens back to back, in the dtype named by the code, little-endian

Here every document is one sequence (no sentence splitting), so the document index is 0, 1, ..., D.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}


def token_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """Megatron's rule: uint16 while every id fits with room to spare (vocab < 65500), int32 beyond."""
    if requested == "auto":
        return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)
    dtype = np.dtype(requested)
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ValueError(f"output.dtype = {requested!r} cannot hold token ids up to {vocab_size - 1}; use auto")
    return dtype


class IndexedDatasetWriter:
    """Appends documents to a `.bin` as they come; `finish()` writes the `.idx` from the recorded lengths.

    Lengths are kept as a list of int32 arrays (4 bytes per document), so memory stays small for any shard.
    """

    def __init__(self, bin_path: str | os.PathLike, idx_path: str | os.PathLike, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        assert self.dtype in DTYPE_CODES, self.dtype
        self.bin_path, self.idx_path = Path(bin_path), Path(idx_path)
        self._bin = open(self.bin_path, "wb")
        self._lengths: list[np.ndarray] = []

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """`tokens` holds the documents back to back; `lengths[i]` is document i's token count."""
        assert int(lengths.sum()) == tokens.size, (int(lengths.sum()), tokens.size)
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size], dtype=np.int32))

    def finish(self) -> tuple[int, int]:
        """Flushes the `.bin`, writes the `.idx`; returns their sizes in bytes."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        write_index(self.idx_path, self.dtype, lengths)
        return self.bin_path.stat().st_size, self.idx_path.stat().st_size

    def abort(self) -> None:
        self._bin.close()


def write_index(path: str | os.PathLike, dtype: np.dtype, lengths: np.ndarray) -> None:
    count = lengths.size
    pointers = np.zeros(count, dtype="<i8")                 # byte offset of each sequence in the .bin
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    document_index = np.arange(count + 1, dtype="<i8")      # one sequence per document
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", DTYPE_CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", count))
        f.write(struct.pack("<Q", document_index.size))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(document_index.tobytes())
        f.flush()
        os.fsync(f.fileno())
