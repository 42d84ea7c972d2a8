# Reader for Megatron-LM's memory-mapped indexed dataset (<prefix>.bin + <prefix>.idx, "MMIDIDX").
#
# Written from the format description, not from Megatron's code. The .idx file is:
#   magic b"MMIDIDX\x00\x00" | version <Q (=1) | dtype code <B | sequence count <Q | document count <Q
#   | sizes int32[sequence count] | pointers int64[sequence count] | document indices int64[document count]
# where "document count" already counts the leading 0, so document i spans sequences
# document_indices[i] .. document_indices[i+1]. Pointers are byte offsets of each sequence in the .bin file.
# Both files are opened with np.memmap so nothing is read until a sample asks for it.
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1

# Megatron's dtype codes. Code 8 (uint16) is what a <65k vocabulary tokenizes into.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}

# magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_HEADER = struct.Struct("<9sQBQQ")


class IndexedDataset:
    """Read-only view of one `<prefix>.bin` / `<prefix>.idx` pair.

    `dataset[i]` is sequence i as a 1-D numpy array (a view into the memory map);
    `get(i, offset, length)` reads part of it without touching the rest.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise ValueError(f"indexed dataset file {path} does not exist (data prefix {self.prefix!r})")

        with open(idx_path, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path} is not a Megatron MMIDIDX index (bad magic {header[:9]!r})")
        _, version, dtype_code, num_sequences, num_documents = _HEADER.unpack(header)
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version} is not supported; valid: {VERSION}")
        if dtype_code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: dtype code {dtype_code} is unknown; valid: {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[dtype_code])

        # The three arrays sit back to back after the header; map them straight out of the file.
        expected = _HEADER.size + 4 * num_sequences + 8 * num_sequences + 8 * num_documents
        actual = idx_path.stat().st_size
        if actual < expected:
            raise ValueError(f"{idx_path} is truncated: {actual} bytes, the header promises {expected}")
        idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(idx_map, dtype=np.int32, count=num_sequences, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(idx_map, dtype=np.int64, count=num_sequences, offset=offset)
        offset += self.pointers.nbytes
        self.document_indices = np.frombuffer(idx_map, dtype=np.int64, count=num_documents, offset=offset)
        self._idx_map = idx_map  # keeps the mapping alive as long as the views are

        bin_size = bin_path.stat().st_size
        if num_sequences and int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize > bin_size:
            raise ValueError(f"{bin_path} is shorter ({bin_size} bytes) than its index says")
        # An empty file cannot be memory-mapped; an empty dataset needs no mapping.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        size = int(self.sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {index} of {size} tokens")
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document_sequences(self, document: int) -> range:
        """Sequence indices that make up document `document`."""
        return range(int(self.document_indices[document]), int(self.document_indices[document + 1]))
