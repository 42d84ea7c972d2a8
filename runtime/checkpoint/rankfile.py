# The rank file (checkpoint format 2): one rank's tensors as raw bytes, then an index saying where each lies.
#
#   [tensor bytes, each 64-byte aligned] [index] [footer, 32 bytes]
#   footer = b"NXDTRNK2" | index offset (u64) | index length (u64) | crc32 of the index (u32) | 4 zero bytes
#
# The index is a torch.save of the rank's header (step, layout, optimizer scalars, extra state: small, and some
# of it tensors) with its pieces (shards.py) as one JSON text, each tensor replaced by a record (byte offset,
# dtype, shape, and the crc32 of every 1 MiB block of its bytes) and each row index by its runs, [[start, stop],
# ...]: JSON parses in C, where the safe unpickler is Python, object by object. The sha256 of the index goes
# into the rank's .done marker and COMMIT, so it vouches for the block checksums and through them for every
# byte. A loading rank reads the footer, the index, then only the byte ranges it needs (reshard.py decides
# which), each widened to whole blocks so that every byte it uses is checked; the reads run on a small thread
# pool, straight into their destination where the layouts allow (pread and crc32 both let go of the GIL), or,
# for a scatter, checked and handed over from a mapping of the file (locally) or a buffer (S3).
# A save writes each tensor's bytes from memory (no serialization, no copy; an async save of host tensors reads
# them in place, chunk by chunk: staging.py) while another thread computes the block checksums from the same
# memory, and (locally) a third starts the disk on what is written.
from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from runtime.parallel.optimizers import STATE_KEYS

try:
    # The same CRC-32 as zlib's, computed with ISA-L's carry-less-multiply kernels: 16 GB/s against zlib's 2 on
    # this machine, which is what checking every block of a load costs (python-isal, the runtime extra's).
    from isal.isal_zlib import crc32
except ImportError:  # the same values, 8x slower
    from zlib import crc32

MAGIC = b"NXDTRNK2"
FOOTER = struct.Struct("<8sQQI4x")
BLOCK = 1 << 20          # bytes per checksum: the most a ranged read reads beyond what it needs, at each end
TASK = 32 << 20          # bytes per read task on the pool (a multiple of BLOCK)
ALIGN = 64
TENSOR_KEYS = ("value", "master", *STATE_KEYS)  # weights, master copies, each optimizer's per-element state
EARLY_FLUSH = 64 << 20   # with flush_early: start writeback of what is written every this many bytes


class DamagedFile(ValueError):
    """A rank file that cannot be trusted; the message names the file and what is wrong, on one line."""


def is_rank_file(head: bytes) -> bool:
    """Whether the last FOOTER.size bytes of a file are a format-2 footer (older rank files are torch zips)."""
    return len(head) == FOOTER.size and head[:len(MAGIC)] == MAGIC


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is contiguous (the writer's tensors are)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def block_crcs(data: memoryview) -> list[int]:
    return [crc32(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    data = memoryview(data)
    while len(data):
        written = os.pwrite(fd, data[:1 << 30], offset)
        data, offset = data[written:], offset + written


class _EarlyFlush:
    """Starts the disk on what is written while the rest is still being written: an fdatasync on a thread of
    its own every EARLY_FLUSH bytes, so the final fsync has little left (the page cache would otherwise hold
    gigabytes of dirty pages until the kernel's own thresholds start writeback)."""

    def __init__(self, fd: int):
        self._fd, self._pending, self._closed = fd, 0, False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="nxdt-checkpoint-flush", daemon=True)
        self._thread.start()

    def wrote(self, n: int) -> None:
        with self._wake:
            self._pending += n
            if self._pending >= EARLY_FLUSH:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending < EARLY_FLUSH and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                self._pending = 0
            try:
                os.fdatasync(self._fd)
            except OSError:  # the writer's own final fsync reports what matters
                return

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()


ROWS = ("index", "experts")  # a piece's row indices: stored as runs


def _runs(rows: torch.Tensor) -> list[list[int]]:
    rows = rows.long().reshape(-1)
    if rows.numel() == 0:
        return []
    ends = ((rows.diff() != 1).nonzero()[:, 0] + 1).tolist()
    return [[int(rows[a]), int(rows[b - 1]) + 1] for a, b in zip([0] + ends, ends + [rows.numel()])]


def _rows(runs: list) -> torch.Tensor:
    if not runs:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(a, b) for a, b in runs])


def saved_tensors(pieces: dict) -> list[torch.Tensor]:
    """The tensors of `pieces` in the order their bytes lie in a rank file."""
    return [piece[key] for section in ("model", "optim") for entries in pieces.get(section, {}).values()
            for piece in entries for key in TENSOR_KEYS if isinstance(piece.get(key), torch.Tensor)]


def _whole(tensors: list[torch.Tensor]) -> Iterator[tuple[int, int, memoryview]]:
    for i, tensor in enumerate(tensors):
        yield i, 0, _bytes(tensor)


def write_rank_file(path: str, header: dict, pieces: dict, *, flush_early: bool = False,
                    chunks: Iterator[tuple[int, int, memoryview]] | None = None) -> dict:
    """Write `header` and `pieces` ({"model": {name: [piece]}, "optim": ...}, tensors on the host) to `path` in
    this format; returns the digest for the .done marker and COMMIT: size and sha256 of the index. The caller
    makes the file durable (the storage's put_file fsyncs it).

    chunks: where the tensors' bytes come from, as (index in saved_tensors(pieces), first byte, bytes), in order
    and each starting on a checksum block (staging.StreamedSnapshot.chunks); a chunk is written and checksummed
    before the next is asked for. Default: each tensor's memory, whole."""
    listed: dict = {}
    records: list[dict] = []
    offset = 0
    for section in ("model", "optim"):
        listed[section] = {}
        for name, entries in pieces.get(section, {}).items():
            out = []
            for piece in entries:
                entry = {k: list(v) if isinstance(v, (tuple, torch.Size)) else v for k, v in piece.items()}
                for key in ROWS:
                    if isinstance(piece.get(key), torch.Tensor):
                        entry[key] = {"runs": _runs(piece[key])}
                for key in TENSOR_KEYS:
                    tensor = piece.get(key)
                    if isinstance(tensor, torch.Tensor):
                        entry[key] = {"offset": offset, "dtype": str(tensor.dtype).removeprefix("torch."),
                                      "shape": list(tensor.shape), "crc32": []}
                        records.append(entry[key])
                        offset += tensor.numel() * tensor.element_size()
                        offset += -offset % ALIGN
                out.append(entry)
            listed[section][name] = out
    if chunks is None:
        chunks = _whole(saved_tensors(pieces))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    flusher = _EarlyFlush(fd) if flush_early else None
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="nxdt-checkpoint-crc") as hasher:
            for i, start, data in chunks:
                assert start % BLOCK == 0, start
                crcs = hasher.submit(block_crcs, data)  # from the same memory, while it is written
                _pwrite_all(fd, data, records[i]["offset"] + start)
                if flusher is not None:
                    flusher.wrote(len(data))
                records[i]["crc32"] += crcs.result()
        buffer = io.BytesIO()
        torch.save({**header, "block_bytes": BLOCK, "pieces": json.dumps(listed, separators=(",", ":"))}, buffer)
        data = buffer.getvalue()
        _pwrite_all(fd, data, offset)
        _pwrite_all(fd, FOOTER.pack(MAGIC, offset, len(data), crc32(data)), offset + len(data))
    finally:
        if flusher is not None:
            flusher.close()
        os.close(fd)
    return {"bytes": offset + len(data) + FOOTER.size, "index_sha256": hashlib.sha256(data).hexdigest()}


def record_bytes(record: dict) -> int:
    return torch.Size(record["shape"]).numel() * dtype_of(record).itemsize


def dtype_of(record: dict) -> torch.dtype:
    return getattr(torch, record["dtype"])


class RankFile:
    """An open rank file: its index (header) read and checked, and ranged reads of its records."""

    def __init__(self, storage, key: str, expected: dict | None = None):
        self.key, self.name = key, key.rsplit("/", 1)[-1]
        try:
            self.reader = storage.reader(key)
        except FileNotFoundError:
            raise DamagedFile(f"{self.name} is missing") from None
        try:
            self.header = self._read_index(expected)
        except BaseException:
            self.reader.close()
            raise

    def _read_index(self, expected: dict | None) -> dict:
        size = self.reader.size
        if expected is not None and size != expected["bytes"]:
            raise DamagedFile(f"{self.name} holds {size} bytes where {expected['bytes']} were written (truncated or "
                              f"overwritten)")
        footer = self.read(max(0, size - FOOTER.size), min(size, FOOTER.size))
        magic, offset, length, crc = FOOTER.unpack(footer) if len(footer) == FOOTER.size else (b"", 0, 0, 0)
        if magic != MAGIC or offset + length + FOOTER.size != size:
            raise DamagedFile(f"{self.name} has no rank-file footer (truncated, or not a format-2 rank file)")
        data = self.read(offset, length)
        if expected is not None and hashlib.sha256(data).hexdigest() != expected["index_sha256"]:
            raise DamagedFile(f"{self.name} does not match its sha256 checksum (damaged index)")
        if crc32(data) != crc:
            raise DamagedFile(f"{self.name} does not match its crc32 checksum (damaged index)")
        try:
            header = torch.load(io.BytesIO(data), weights_only=True)
            listed = json.loads(header.pop("pieces"))
        except Exception as error:  # noqa: BLE001 - a damaged index surfaces as several kinds of error
            raise DamagedFile(f"{self.name} cannot be read ({' '.join(str(error).split())[:160]})") from error
        for section in ("model", "optim"):
            for entries in listed.get(section, {}).values():
                for piece in entries:
                    for key in ROWS:
                        if isinstance(piece.get(key), dict):
                            piece[key] = _rows(piece[key]["runs"])
                    for key in ("full_shape", "shard_shape"):
                        piece[key] = tuple(piece[key])
            header[section] = listed.get(section, {})
        return header

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        got = self.reader.read_into(offset, [memoryview(buffer)])
        if got != length:
            raise DamagedFile(f"{self.name} ends at byte {offset + got}, before byte {offset + length} (truncated)")
        return bytes(buffer)

    def records(self):
        """Every tensor record of the file."""
        for section in ("model", "optim"):
            for entries in self.header.get(section, {}).values():
                for piece in entries:
                    for key in TENSOR_KEYS:
                        if isinstance(piece.get(key), dict):
                            yield piece[key]

    def close(self) -> None:
        self.reader.close()


# ---- ranged reads --------------------------------------------------------------------------------------------

@dataclass
class Read:
    """Elements [first, stop) of one record into `dest` (contiguous, the record's dtype, stop - first elements),
    or, with `sink`, chunk by chunk from a mapping of the file or a buffer of the reading thread: sink(first
    element, chunk) is called with each `chunk` elements (the last may be fewer) once they are checked, while
    they are still in the cache. A sink read starts on a block boundary and its chunks are whole blocks."""

    file: RankFile
    record: dict
    first: int
    stop: int
    dest: torch.Tensor | None  # None (and no sink): read to check only (integrity)
    sink: Callable[[int, torch.Tensor], None] | None = None
    chunk: int = 0


@dataclass
class _Task:
    file: RankFile
    record: dict
    start: int                      # bytes of the record this task covers: [start, stop)
    stop: int
    dest: memoryview | None         # where bytes [start + head, stop - tail) go; None: read to check only
    head: int = 0                   # bytes before and after `dest` read only to check their blocks
    tail: int = 0
    verify: bool = True
    sink: Callable[[int, torch.Tensor], None] | None = None
    step: int = 0                   # with sink: bytes per sink call (whole blocks)


def _tasks(read: Read, verify: bool) -> list[_Task]:
    size = dtype_of(read.record).itemsize
    total = record_bytes(read.record)
    lo, hi = read.first * size, read.stop * size
    if hi <= lo:
        return []
    if read.sink is not None:
        step = read.chunk * size
        assert not verify or (lo % BLOCK == 0 and step % BLOCK == 0), (lo, step)
        # A mapped task is mapped whole and handed to the sink chunk by chunk; a read one is one chunk.
        span = step * max(1, TASK // step) if hasattr(read.file.reader, "map") else step
        tasks = []
        for a in range(lo, hi, span):
            b = min(a + span, hi)
            end = min(-(-b // BLOCK) * BLOCK, total) if verify else b
            tasks.append(_Task(read.file, read.record, a, end, None, tail=end - b, verify=verify, sink=read.sink,
                               step=step))
        return tasks
    if read.dest is None:
        return [_Task(read.file, read.record, a, min(a + TASK, total), None)
                for a in range(lo - lo % BLOCK, hi, TASK)]
    dest = _bytes(read.dest)
    assert len(dest) == hi - lo, (len(dest), lo, hi)
    start, stop = (lo - lo % BLOCK, min(-(-hi // BLOCK) * BLOCK, total)) if verify else (lo, hi)
    tasks = []
    for a in range(start, stop, TASK):  # TASK is whole blocks: every task checks whole blocks of its own
        b = min(a + TASK, stop)
        tasks.append(_Task(read.file, read.record, a, b, dest[max(a, lo) - lo:min(b, hi) - lo],
                           head=max(0, lo - a), tail=max(0, b - hi), verify=verify))
    return tasks


_scratch = threading.local()


def _thread_buffer(nbytes: int) -> memoryview:
    """This thread's reusable buffer for sink reads: its pages stay mapped (and its lines cached) across tasks."""
    if getattr(_scratch, "buffer", None) is None or len(_scratch.buffer) < nbytes:
        _scratch.buffer = bytearray(max(nbytes, TASK))
    return memoryview(_scratch.buffer)[:nbytes]


def _run(task: _Task) -> None:
    if task.sink is not None:
        return _run_sink(task)
    if task.dest is None:
        buffers = [memoryview(bytearray(task.stop - task.start))]
    else:  # scratch for the partial blocks at the ends, allocated only now: at most two blocks per running task
        buffers = [memoryview(bytearray(task.head)), task.dest, memoryview(bytearray(task.tail))]
    _read(task.file, task.record, task.start, task.stop, buffers)
    if task.verify:
        _check(task.file, task.record, task.start, buffers)


def _read(file: RankFile, record: dict, start: int, stop: int, buffers: list[memoryview]) -> None:
    offset = record["offset"] + start
    got = file.reader.read_into(offset, buffers)
    if got != stop - start:
        raise DamagedFile(f"{file.name} ends at byte {offset + got}, before byte {offset + stop - start} (truncated)")


def _run_sink(task: _Task) -> None:
    """Hand the sink the task's bytes a chunk at a time, each checked just before (so it is in the cache): from a
    mapping of the whole task where the reader maps (no copy before the sink's), else read into a buffer."""
    file, record, dtype = task.file, task.record, dtype_of(task.record)
    data_stop = task.stop - task.tail
    mapped = file.reader.map(record["offset"] + task.start, task.stop - task.start) \
        if hasattr(file.reader, "map") else None
    for a in range(task.start, data_stop, task.step):
        b = min(a + task.step, data_stop)
        end = task.stop if b == data_stop else b  # the last chunk checks the tail's block too
        if mapped is not None:
            chunk = mapped[a - task.start:end - task.start]
        else:
            chunk = _thread_buffer(end - a)
            _read(file, record, a, end, [chunk])
        if task.verify:
            _check(file, record, a, [chunk])
        task.sink(a // dtype.itemsize, torch.frombuffer(chunk, dtype=dtype, count=(b - a) // dtype.itemsize))


def _check(file: RankFile, record: dict, start: int, buffers: list[memoryview]) -> None:
    """Check the blocks that `buffers` (the record's bytes from `start`, a block boundary) hold."""
    crcs, total = record["crc32"], record_bytes(record)
    block = start // BLOCK
    left, crc = min(BLOCK, total - block * BLOCK), 0
    for buffer in buffers:
        at = 0
        while at < len(buffer):
            take = min(left, len(buffer) - at)
            crc = crc32(buffer[at:at + take], crc)
            at, left = at + take, left - take
            if left == 0:
                if block >= len(crcs) or crc != crcs[block]:
                    first = record["offset"] + block * BLOCK
                    raise DamagedFile(f"{file.name} does not match its crc32 checksum at bytes {first}-"
                                      f"{first + min(BLOCK, total - block * BLOCK)} (damaged)")
                block += 1
                left, crc = min(BLOCK, total - block * BLOCK), 0


def run_reads(reads: list[Read], pool: ThreadPoolExecutor, *, verify: bool) -> None:
    """Run the reads on `pool`, largest first; with verify, check every block they touch against the index."""
    tasks = [task for read in reads for task in _tasks(read, verify)]
    tasks.sort(key=lambda t: t.start - t.stop)
    for future in [pool.submit(_run, task) for task in tasks]:
        future.result()


def check_rank_file(file: RankFile, pool: ThreadPoolExecutor) -> None:
    """Read every record of `file` and check each block; DamagedFile names the first bad one."""
    run_reads([Read(file, record, 0, torch.Size(record["shape"]).numel(), None) for record in file.records()],
              pool, verify=True)


def mapped_pieces(file: RankFile, path: str) -> dict:
    """The file's header with every record replaced by its tensor, a view of the memory-mapped file at `path`
    (pages are read when touched): for readers that want whole tensors (conversion, tests)."""
    import mmap

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(f.fileno()).st_size else None

    def tensor(record: dict) -> torch.Tensor:
        numel = torch.Size(record["shape"]).numel()
        if numel == 0:
            return torch.empty(record["shape"], dtype=dtype_of(record))
        return torch.frombuffer(mapped, dtype=dtype_of(record), count=numel,
                                offset=record["offset"]).view(record["shape"])

    out = dict(file.header)
    for section in ("model", "optim"):
        out[section] = {name: [{k: tensor(v) if k in TENSOR_KEYS and isinstance(v, dict) else v
                                for k, v in piece.items()} for piece in entries]
                        for name, entries in file.header.get(section, {}).items()}
    return out
