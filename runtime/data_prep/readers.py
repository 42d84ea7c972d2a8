"""Reading input files as chunks of documents, cheaply enough to keep every tokenizer worker busy.

The reading process only decompresses and cuts bytes at line ends; JSON parsing happens in the workers
(encode.py), because that is where the CPU time is. Chunks carry the line number they start at, so a bad
line is reported as `file:line` however the work was spread.

Formats: JSON lines (.jsonl, or .json whose first character is not "["), a JSON array of objects (.json
starting with "["; read whole), each optionally .gz or .zst, and .parquet (a column named by text_key; needs
pyarrow).
"""
from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from runtime.schema.data_preparation import DataError


@dataclass
class Chunk:
    kind: str           # "lines": JSON lines as bytes | "records": parsed objects | "texts": strings
    first_line: int     # 1-based line (or record) number of the chunk's first item
    payload: Any
    position: int       # bytes of the file on disk consumed so far, for progress


def _open_decompressed(path: str) -> tuple[BinaryIO, BinaryIO]:
    """(stream of the decompressed bytes, the file on disk whose tell() measures progress)."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(f"{path}: reading .zst needs the zstandard package; pip install zstandard") from None
        # The Pile's shards were written with a long window; allow up to 2 GiB like `zstd --long=31`.
        reader = zstandard.ZstdDecompressor(max_window_size=1 << 31).stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader, buffer_size=1 << 20), raw
    return raw, raw


def iter_chunks(path: str, text_key: str = "text", chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    if path.endswith(".parquet"):
        yield from _parquet_chunks(path, text_key, chunk_bytes)
        return
    stream, raw = _open_decompressed(path)
    try:
        first = stream.peek(64)[:64] if hasattr(stream, "peek") else b""
        if path.endswith((".json", ".json.gz", ".json.zst")) and first.lstrip()[:1] == b"[":
            yield from _array_chunks(path, stream, raw, text_key, chunk_bytes)
        else:
            yield from _line_chunks(stream, raw, chunk_bytes)
    except (OSError, EOFError) as err:
        # Truncated gzip/zstd streams surface here; name the file so the user knows which one to fetch again.
        raise DataError(f"{path}: cannot read ({err}); the file may be truncated or corrupt") from None
    finally:
        stream.close()
        raw.close()


def _line_chunks(stream: BinaryIO, raw: BinaryIO, chunk_bytes: int) -> Iterator[Chunk]:
    carry = b""
    line = 1
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            break
        cut = block.rfind(b"\n")
        if cut < 0:                      # one line longer than a chunk: keep reading until it ends
            carry += block
            continue
        payload = carry + block[: cut + 1]
        carry = block[cut + 1:]
        yield Chunk("lines", line, payload, raw.tell())
        line += payload.count(b"\n")
    if carry:
        yield Chunk("lines", line, carry, raw.tell())


def _array_chunks(path: str, stream: BinaryIO, raw: BinaryIO, text_key: str, chunk_bytes: int) -> Iterator[Chunk]:
    try:
        records = json.load(stream)
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err}); a .json file holds one array or JSON lines") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json file must hold an array of objects or JSON lines")
    position = raw.tell()
    batch, start, size = [], 1, 0
    for number, record in enumerate(records, 1):
        batch.append(record)
        text = record.get(text_key) if isinstance(record, dict) else None
        size += len(text) if isinstance(text, str) else 64
        if size >= chunk_bytes:
            yield Chunk("records", start, batch, position)
            batch, start, size = [], number + 1, 0
    if batch:
        yield Chunk("records", start, batch, position)


def _parquet_chunks(path: str, key: str, chunk_bytes: int) -> Iterator[Chunk]:
    try:
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
    # Row batches sized so a chunk holds roughly chunk_bytes of text on average.
    batch_rows = max(16, chunk_bytes // 2048)
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[key]):
        texts = batch.column(0).to_pylist()
        row += len(texts)
        yield Chunk("texts", row - len(texts), texts, int(size * (row - 1) / rows_total))
