# The asynchronous save of host tensors (CPU training) without a host copy of the state: the writer thread reads
# the live tensors in place, chunk by chunk, while the next step's forward and backward read (never write) them.
# Before the optimizer's next update changes a weight or a moment in place, its pre-step hook calls freeze(): every
# chunk not yet written is copied into a bounded ring of chunk-sized slots (waiting, when the ring is full, for the
# writer to free a slot), and the chunk the writer is reading in place is waited for. After freeze() nothing is
# read from the live tensors, so the file holds the state of the step the save names, whatever the update does.
#
# Host memory besides the state: the ring (runtime/schema/facts.py checkpoint_staging_bytes, which the launch's
# estimate counts), allocated at the first save that needs it and kept. The ring only shortens the update's wait
# when the writer is slower than a forward and backward; with no slots the update waits for the whole write.
# Accelerators keep the full device -> host copy at save time (shards.HostStaging): the writer thread cannot read
# device memory while the next step runs.
from __future__ import annotations

import threading
from typing import Iterator

import torch

from runtime.schema.facts import CHECKPOINT_CHUNK_BYTES

PENDING, LIVE, STAGING, STAGED, DONE = range(5)  # a chunk's state: PENDING -> LIVE | STAGING -> STAGED -> DONE


class ChunkRing:
    """`budget` bytes of host memory as whole slots of `chunk` bytes, allocated at first use, reused by every save
    (one in flight at a time)."""

    def __init__(self, budget: int, chunk: int = CHECKPOINT_CHUNK_BYTES):
        self.chunk, self.slots = chunk, max(0, budget // chunk)
        self._buffer: torch.Tensor | None = None
        self._free: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.slots * self.chunk

    def reset(self) -> None:
        if self._buffer is None and self.slots:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        self._free = list(range(self.slots))

    def has_free(self) -> bool:
        return bool(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self._buffer[slot * self.chunk:slot * self.chunk + nbytes]


class StreamedSnapshot:
    """The host tensors of one save, handed to the writer as chunks of their bytes (chunks(), on the writer thread)
    and kept from change by freeze() (on the training thread, before the tensors change)."""

    def __init__(self, name: str, tensors: list[torch.Tensor], ring: ChunkRing):
        self.name, self.tensors, self.ring = name, tensors, ring
        self._flat = []
        self._chunks: list[tuple[int, int, int]] = []  # (tensor, first byte, end byte)
        for i, tensor in enumerate(tensors):
            assert tensor.is_cpu and tensor.is_contiguous(), "the writer reads host tensors in place"
            self._flat.append(tensor.detach().reshape(-1).view(torch.uint8))
            nbytes = tensor.numel() * tensor.element_size()
            self._chunks += [(i, a, min(a + ring.chunk, nbytes)) for a in range(0, nbytes, ring.chunk)]
        self._state = [PENDING] * len(self._chunks)
        self._slot: dict[int, int] = {}
        self._changed = threading.Condition()
        self._closed = False
        self.frozen = False     # freeze() has returned
        self.staged_bytes = 0  # how much freeze() copied (the rest was written in place)
        ring.reset()

    def chunks(self) -> Iterator[tuple[int, int, memoryview]]:
        """(tensor index, first byte, its bytes) in file order. A chunk's memory is the writer's until it asks
        for the next one (or the generator ends): it must have written and checksummed it by then."""
        for c, (i, a, b) in enumerate(self._chunks):
            with self._changed:
                while self._state[c] == STAGING:
                    self._changed.wait()
                slot = self._slot.get(c)
                if slot is None:
                    self._state[c] = LIVE
            data = self._flat[i][a:b] if slot is None else self.ring.view(slot, b - a)
            try:
                yield i, a, memoryview(data.numpy())
            finally:
                with self._changed:
                    if slot is not None:
                        self.ring.give(slot)
                    self._state[c] = DONE
                    self._changed.notify_all()

    def freeze(self) -> None:
        """Return once no chunk will be read from the live tensors again: copy the unwritten ones into the ring,
        wait for the one being written in place. Returns at once after close() (a failed or finished write)."""
        for c, (i, a, b) in enumerate(self._chunks):
            with self._changed:
                while self._state[c] == PENDING and not self.ring.has_free() and not self._closed:
                    self._changed.wait()
                if self._closed:
                    break
                if self._state[c] != PENDING:  # the writer has it (in place) or is done with it
                    continue
                slot = self._slot[c] = self.ring.take()
                self._state[c] = STAGING
            self.ring.view(slot, b - a).copy_(self._flat[i][a:b])
            self.staged_bytes += b - a
            with self._changed:
                self._state[c] = STAGED
                self._changed.notify_all()
        with self._changed:
            while LIVE in self._state and not self._closed:
                self._changed.wait()
        self.frozen = True

    def close(self) -> None:
        """The writer is done with the snapshot (written, or failed): freeze() has nothing to wait for."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
