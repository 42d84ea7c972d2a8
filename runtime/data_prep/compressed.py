"""Opening .gz and .zst inputs as streams, and making sure each was read to its end.

Python's gzip module raises EOFError when the input stops inside a member. zstandard's stream_reader does not:
when the input stops inside a frame it returns a clean end of stream, so half a .jsonl.zst reads as a shorter,
valid-looking corpus. So the compressed bytes of a .zst pass through FrameWalker on their way to the
decompressor; it follows the frame layout (RFC 8878: frame header, blocks, optional checksum; skippable frames)
without decompressing anything, and when the file ends it checks that it ended where a frame ends.

A file cut exactly between two frames (or two gzip members) is itself a valid, shorter file: neither format
marks the last frame, so no reader can tell it from one written that way.
"""
from __future__ import annotations

import gzip
import io
from typing import BinaryIO

from runtime.schema.data_preparation import DataError

_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = range(0x184D2A50, 0x184D2A60)
_AGAIN = "fetch or write the file again (the shard is not marked complete)"


def open_decompressed(path: str) -> tuple[BinaryIO, BinaryIO]:
    """(stream of the decompressed bytes, the file on disk, whose tell() is the compressed offset)."""
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
        reader = zstandard.ZstdDecompressor(max_window_size=1 << 31).stream_reader(
            FrameWalker(raw, path), read_across_frames=True, closefd=False)
        return io.BufferedReader(reader, buffer_size=1 << 20), raw
    return raw, raw


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged input raises (besides the DataError of FrameWalker)."""
    try:
        from zstandard import ZstdError
    except ImportError:
        return OSError, EOFError
    return OSError, EOFError, ZstdError


def read_failure(path: str, err: BaseException, offset: int) -> DataError:
    """The one-line error for an exception of read_errors(); `offset` is how far into the file reading got."""
    if isinstance(err, EOFError) and path.endswith(".gz"):
        return DataError(f"{path}: truncated: the input ends at byte {offset} before the gzip end-of-stream "
                         f"marker; {_AGAIN}")
    return DataError(f"{path}: cannot read near byte {offset} ({err}); the file is truncated or corrupt: {_AGAIN}")


class FrameWalker:
    """Passes a .zst file's bytes through unchanged while following its frames; raises DataError when the file
    ends inside a frame, naming the byte where it ended and where that frame began.

    The walker reads fixed-size fields (magic number, frame header, 3-byte block headers) and skips over block
    contents, so its work is one step per block (at most 128 KiB each), not per byte."""

    def __init__(self, raw: BinaryIO, path: str):
        self.raw, self.path = raw, path
        self.offset = 0              # bytes passed through so far
        self.frame_start = 0         # where the frame being walked began
        self._field = bytearray()    # the field being gathered (it may straddle two reads)
        self._want, self._then = 4, self._magic
        self._skip = 0               # content bytes to pass over before the next field
        self._checksum = 0           # bytes of content checksum after the current frame's last block

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        if data:
            self._walk(data)
        elif size != 0:
            self._check_end()
        return data

    def close(self) -> None:
        pass                         # the caller owns the file

    def _walk(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                step = min(self._skip, n - i)
                self._skip -= step
                i += step
                continue
            if not self._field and self._then == self._magic:
                self.frame_start = self.offset + i
            step = min(self._want - len(self._field), n - i)
            self._field += data[i:i + step]
            i += step
            if len(self._field) == self._want:
                field = bytes(self._field)
                self._field.clear()
                self._then(field, self.offset + i)
        self.offset += n

    def _expect(self, size: int, then) -> None:
        self._want, self._then = size, then

    def _magic(self, field: bytes, at: int) -> None:
        magic = int.from_bytes(field, "little")
        if magic == _ZSTD_MAGIC:
            self._expect(1, self._descriptor)
        elif magic in _SKIPPABLE_MAGIC:
            self._expect(4, self._skippable_size)
        else:
            raise DataError(f"{self.path}: byte {at - 4} does not start a zstd frame (magic {magic:#010x}); the "
                            f"file is corrupt or not zstd: {_AGAIN}")

    def _skippable_size(self, field: bytes, at: int) -> None:
        self._skip = int.from_bytes(field, "little")
        self._expect(4, self._magic)

    def _descriptor(self, field: bytes, at: int) -> None:
        descriptor = field[0]
        single_segment = (descriptor >> 5) & 1
        self._checksum = 4 if descriptor & 0b100 else 0
        header = ((0 if single_segment else 1)                        # window descriptor
                  + (0, 1, 2, 4)[descriptor & 0b11]                   # dictionary id
                  + (single_segment, 2, 4, 8)[descriptor >> 6])       # frame content size
        if header:
            self._expect(header, self._header)
        else:
            self._expect(3, self._block)

    def _header(self, field: bytes, at: int) -> None:
        self._expect(3, self._block)

    def _block(self, field: bytes, at: int) -> None:
        header = int.from_bytes(field, "little")
        last, kind, size = header & 1, (header >> 1) & 0b11, header >> 3
        if kind == 3:
            raise DataError(f"{self.path}: byte {at - 3}: a zstd block of the reserved type; the file is corrupt: "
                            f"{_AGAIN}")
        self._skip = 1 if kind == 1 else size                         # an RLE block holds one byte
        if last:
            self._skip += self._checksum
            self._expect(4, self._magic)
        else:
            self._expect(3, self._block)

    def _check_end(self) -> None:
        if self._then == self._magic and not self._field and not self._skip:
            return
        raise DataError(f"{self.path}: truncated: the input ends at byte {self.offset} inside the zstd frame "
                        f"that starts at byte {self.frame_start}; {_AGAIN}")
