"""Reading input files as chunks of documents, cheaply enough to keep every tokenizer worker busy.

The reading process only decompresses and cuts bytes at record ends; JSON parsing happens in the workers
(encode.py), because that is where the CPU time is. Chunks carry the line number they start at, so a bad
line is reported as `file:line` however the work was spread.

Memory is bounded by the chunk size plus `max_record_bytes`, however long a line is: the input is read in
chunk-sized blocks, and a record is kept only while it is within the limit. Past the limit its bytes are
counted and dropped as they are read; the chunk lists it in `too_long` and leaves an empty place for it, so
the numbers of the records after it stay right.

Formats: JSON lines (.jsonl, or .json whose first character is not "["), a JSON array of values (.json
starting with "["; cut into one JSON text per value while streaming), each optionally .gz or .zst (read to
the end of the stream or failed: compressed.py), and .parquet (a column named by text_key; needs pyarrow).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from runtime.data_prep.compressed import open_decompressed, read_errors, read_failure
from runtime.schema.data_preparation import DataError, InputConfig

DEFAULT_MAX_RECORD_BYTES = int(InputConfig.max_record_mb * 1e6)


@dataclass
class Chunk:
    kind: str           # "lines": JSON lines as bytes | "values": one JSON text (bytes) per record | "texts": strings
    first_line: int     # 1-based line (or record) number of the chunk's first item
    payload: Any
    position: int       # bytes of the file on disk consumed so far, for progress
    # (line or record number, bytes) of the records left out for being longer than the limit; their place in the
    # payload is empty (an empty line, b"" or None), so no worker sees them
    too_long: list[tuple[int, int]] = field(default_factory=list)


def iter_chunks(path: str, text_key: str = "text", chunk_bytes: int = 1 << 20,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Chunk]:
    if path.endswith(".parquet"):
        yield from _parquet_chunks(path, text_key, chunk_bytes, max_record_bytes)
        return
    stream, raw = open_decompressed(path)
    try:
        first = stream.peek(64)[:64] if hasattr(stream, "peek") else b""
        if path.endswith((".json", ".json.gz", ".json.zst")) and first.lstrip()[:1] == b"[":
            yield from _array_chunks(path, stream, raw, chunk_bytes, max_record_bytes)
        else:
            yield from _line_chunks(stream, raw, chunk_bytes, max_record_bytes)
    except read_errors() as err:
        # Truncated or corrupt gzip/zstd streams surface here (a zstd stream that merely stops is caught by
        # compressed.FrameWalker); name the file and the offset so the user knows what to fetch again.
        raise read_failure(path, err, raw.tell()) from None
    finally:
        stream.close()
        raw.close()


def _line_chunks(stream: BinaryIO, raw: BinaryIO, chunk_bytes: int, limit: int) -> Iterator[Chunk]:
    line = 1                      # the number of the first line not handed out yet
    head: list[bytes] = []        # the unfinished line read so far, while it is within the limit
    head_size = 0                 # its length so far (still counted once it is dropped)
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            break
        first = block.find(b"\n")
        if first < 0:             # the unfinished line goes on past this block
            head_size += len(block)
            if head_size <= limit:
                head.append(block)
            else:
                head.clear()
            continue
        too_long: list[tuple[int, int]] = []
        head_size += first
        if head_size > limit:
            too_long.append((line, head_size))
            parts = [b"\n"]
        else:
            parts = [*head, block[:first + 1]]
        cut = block.rfind(b"\n")
        rest = block[first + 1:cut + 1]
        if len(rest) > limit:     # only then can a line that starts and ends in this block be too long
            rest = _drop_long_lines(rest, limit, line + 1, too_long)
        parts.append(rest)
        payload = b"".join(parts)
        yield Chunk("lines", line, payload, raw.tell(), too_long)
        line += payload.count(b"\n")
        tail = block[cut + 1:]
        head, head_size = ([tail] if tail and len(tail) <= limit else []), len(tail)
    if head_size > limit:         # the last line, without a newline
        yield Chunk("lines", line, b"", raw.tell(), [(line, head_size)])
    elif head:
        yield Chunk("lines", line, b"".join(head), raw.tell())


def _drop_long_lines(lines: bytes, limit: int, first_number: int, too_long: list[tuple[int, int]]) -> bytes:
    """`lines` (ending with a newline) with every line longer than `limit` emptied and listed in too_long."""
    parts = lines.split(b"\n")
    for offset, text in enumerate(parts):
        if len(text) > limit:
            too_long.append((first_number + offset, len(text)))
            parts[offset] = b""
    return b"\n".join(parts)


# Only brackets, braces and commas outside strings matter. _PLAIN runs up to the next of them in one regex call,
# passing over whole strings (escaped quotes included); it stops at a quote only when the string does not end in
# this block, and _STRING_BODY then finds its end in the next ones.
_STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
_PLAIN = re.compile(rb'(?:[^"\[\]{},]++|"(?:[^"\\]++|\\.)*+")*+', re.DOTALL)
_WHITESPACE = b" \t\r\n"


class _ArraySplitter:
    """Cuts a JSON array, fed in blocks, into the JSON texts of its values. Tracks strings and nesting depth
    only; each value is parsed (and any error in it reported as that record's) by the worker."""

    def __init__(self, path: str, limit: int):
        self.path, self.limit = path, limit
        self.depth = 0
        self.in_string = self.escaped = self.closed = False
        self.value: list[bytes] = []      # the current value's bytes so far, while within the limit
        self.value_size = 0
        self.number = 0                   # values finished so far
        self.values: list[bytes] = []     # finished values not handed out yet
        self.too_long: list[tuple[int, int]] = []

    def feed(self, block: bytes, offset: int) -> None:
        """`offset`: where the block starts in the decompressed stream (for error messages)."""
        i, n = 0, len(block)
        start = 0 if self.depth >= 1 else None      # where the current value's bytes start in this block
        while i < n:
            if self.closed:
                rest = block[i:]
                if rest.strip(_WHITESPACE):
                    at = offset + i + len(rest) - len(rest.lstrip(_WHITESPACE))
                    raise DataError(f"{self.path}: byte {at} of the JSON text: more data after the array ends; a "
                                    ".json file holds one array of objects or JSON lines")
                return
            if self.in_string:
                if self.escaped:
                    i, self.escaped = i + 1, False
                    continue
                end = _STRING_BODY.match(block, i).end()
                if end >= n:
                    i = n
                elif block[end] == 0x5C:             # a backslash ending the block: its pair is in the next
                    i, self.escaped = n, True
                else:
                    i, self.in_string = end + 1, False
                continue
            j = _PLAIN.match(block, i).end()
            if j == n:
                if self.depth == 0 and block[i:].strip(_WHITESPACE):
                    raise self._not_array(offset + i)
                i = n
                continue
            char = block[j]
            if self.depth == 0:
                if char != 0x5B or block[i:j].strip(_WHITESPACE):
                    raise self._not_array(offset + i)
                self.depth, start = 1, j + 1
            elif char == 0x22:                       # "
                self.in_string = True
            elif char in b"[{":
                self.depth += 1
            elif char in b"]}":
                self.depth -= 1
                if self.depth == 0:
                    self._finish(block, start, j, last=True)
                    self.closed, start = True, None
            elif char == 0x2C and self.depth == 1:   # , between two values of the array
                self._finish(block, start, j, last=False)
                start = j + 1
            i = j + 1
        if start is not None:
            self._add(block[start:])

    def end(self, offset: int) -> None:
        if not self.closed:
            raise DataError(f"{self.path}: the JSON array is not closed: the text ends at byte {offset}; the file is "
                            "truncated or not one JSON array (the shard is not marked complete)")

    def _add(self, piece: bytes) -> None:
        self.value_size += len(piece)
        if self.value_size <= self.limit:
            self.value.append(piece)
        else:
            self.value.clear()

    def _finish(self, block: bytes, start: int, stop: int, last: bool) -> None:
        self._add(block[start:stop])
        text = b"".join(self.value)
        empty = self.value_size <= self.limit and not text.strip(_WHITESPACE)
        if not (last and empty and self.number == 0):   # "[ ]" holds no values; "[1, ]" has a bad last one
            self.number += 1
            if self.value_size > self.limit:
                self.too_long.append((self.number, self.value_size))
                text = b""
            self.values.append(text)
        self.value, self.value_size = [], 0

    def _not_array(self, at: int) -> DataError:
        return DataError(f"{self.path}: byte {at} of the JSON text: expected the array to start; a .json file "
                         "holds one array of objects or JSON lines")


def _array_chunks(path: str, stream: BinaryIO, raw: BinaryIO, chunk_bytes: int, limit: int) -> Iterator[Chunk]:
    splitter, offset, first = _ArraySplitter(path, limit), 0, 1
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            break
        splitter.feed(block, offset)
        offset += len(block)
        if splitter.values or splitter.too_long:
            yield Chunk("values", first, splitter.values, raw.tell(), splitter.too_long)
            first += len(splitter.values)
            splitter.values, splitter.too_long = [], []
    splitter.end(offset)


def _parquet_chunks(path: str, key: str, chunk_bytes: int, limit: int) -> Iterator[Chunk]:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs the pyarrow package; pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    if key not in parquet.schema_arrow.names:
        raise DataError(f"{path}: no column {key!r} (input.text_key); columns are "
                        f"{', '.join(parquet.schema_arrow.names)}")
    size = os.path.getsize(path)
    rows_total = max(1, parquet.metadata.num_rows)
    row = 1
    # Row batches sized so a chunk holds roughly chunk_bytes of text on average. A row group is read whole
    # (that is how parquet stores it), so here the limit keeps long texts from the workers, not from memory.
    batch_rows = max(16, chunk_bytes // 2048)
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[key]):
        column, too_long = batch.column(0), []
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            sizes = pc.binary_length(column)
            over = pc.fill_null(pc.greater(sizes, limit), False)
            if pc.any(over).as_py():
                too_long = [(row + i, sizes[i].as_py()) for i in pc.indices_nonzero(over).to_pylist()]
                column = pc.if_else(over, pa.scalar(None, column.type), column)
        texts = column.to_pylist()
        yield Chunk("texts", row, texts, int(size * (row + len(texts) - 1) / rows_total), too_long)
        row += len(texts)
