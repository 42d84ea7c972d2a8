# An asynchronous save without a host copy of the state: the writer thread streams the saved step's tensors to the
# rank file, unit by unit, while the next step's forward and backward only read them. Before the optimizer's next
# update changes a weight or a moment, its pre-step hook calls freeze(): every unit not yet taken by the writer is
# brought into a bounded ring of host memory (waiting, when the ring is full, for the writer to free room), and the
# unit the writer is reading from the live state is waited for. After freeze() nothing is read from the live
# tensors, so the file holds the step the save names, whatever the update does. A sync save streams the same way
# on the calling thread (nothing changes under it).
#
# How a unit's bytes reach the host is the device's (runtime/device.py checkpoint_transfer), the only difference:
#   CPU   units are chunks of the live host tensors, which the writer reads in place; freeze() copies into slots
#   GPU   units are chunks, copied device -> host into page-locked slots on a side stream (the writer's and
#         freeze()'s copies alike)
#   XLA   units are whole device tensors (a slice would be a graph: a compile), the flat buffers the saved pieces
#         are ranges of (shards.rank_pieces' origins); the ring is a byte budget, and a tensor larger than it
#         transfers alone. The update's freeze() runs while the step is traced, before its graph runs and donates
#         the buffers it updates: the device still holds the saved step's values.
#
# Host memory besides the state: the ring (runtime/schema/facts.py checkpoint_staging_bytes, which the launch's
# estimate counts), kept from the first save on (XLA's budget: what the transfers hold at most, freed after each).
# The bigger the ring, the less the update waits for the writer to get through what the ring cannot hold.
from __future__ import annotations

import threading
from typing import Iterator

import torch

from runtime.device import HostTransfer, checkpoint_transfer
from runtime.schema.facts import CHECKPOINT_CHUNK_BYTES

# A unit's state: PENDING -> LIVE (the writer reads or transfers it) [-> FETCHED (device: its host copy in hand)]
# -> DONE, or PENDING -> STAGING (freeze() brings it into the ring) -> STAGED -> DONE.
PENDING, LIVE, FETCHED, STAGING, STAGED, DONE = range(6)


class ChunkRing:
    """`budget` bytes of host memory as whole slots of `chunk` bytes (at least `minimum` of them), allocated at
    first use and reused by every save (one in flight at a time); page-locked with `pin`."""

    def __init__(self, budget: int, chunk: int = CHECKPOINT_CHUNK_BYTES, *, minimum: int = 0, pin: bool = False):
        self.chunk, self.slots, self.pin = chunk, max(minimum, budget // chunk), pin
        self._buffer: torch.Tensor | None = None
        self._free: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.slots * self.chunk

    def reset(self) -> None:
        if self._buffer is None and self.slots:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self._free = list(range(self.slots))

    def has_room(self, nbytes: int) -> bool:
        assert nbytes <= self.chunk
        return bool(self._free)

    def take(self, nbytes: int) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self._buffer[slot * self.chunk:slot * self.chunk + nbytes]


class ByteBudget:
    """At most `budget` bytes of host copies at once, in units of any size, each allocated by its transfer and
    freed after it is written; a unit larger than the budget is taken alone. nbytes: the most held at once."""

    def __init__(self, budget: int):
        self.budget, self.used, self.nbytes = budget, 0, 0

    def reset(self) -> None:
        self.used = 0

    def has_room(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.budget

    def take(self, nbytes: int) -> int:
        self.used += nbytes
        self.nbytes = max(self.nbytes, self.used)
        return nbytes

    def give(self, nbytes: int) -> None:
        self.used -= nbytes

    def view(self, token: int, nbytes: int) -> None:
        return None  # the transfer allocates its own


def make_ring(transfer: type[HostTransfer], budget: int) -> ChunkRing | ByteBudget:
    """The ring a save of tensors moved by `transfer` uses: slots of chunks, at least one where the writer cannot
    read in place; a byte budget where only whole tensors transfer."""
    if transfer.whole_tensors:
        return ByteBudget(budget)
    return ChunkRing(budget, minimum=0 if transfer.in_place else 1, pin=transfer.pin)


class StreamedSnapshot:
    """The tensors of one save, handed to the writer as chunks of their bytes (chunks(), on the writer thread)
    and kept from change by freeze() (on the training thread, before the tensors change).

    origins: {id(tensor): (base, first element)} for tensors that are ranges of flat base tensors (needed where
    only whole tensors transfer); transfer: how bytes reach the host (default: the tensors' device's)."""

    def __init__(self, name: str, tensors: list[torch.Tensor], ring: ChunkRing | ByteBudget, *,
                 origins: dict | None = None, transfer: type[HostTransfer] | None = None):
        self.name, self.ring = name, ring
        kind = transfer or checkpoint_transfer(tensors[0] if tensors else None)
        chunk = ring.chunk if isinstance(ring, ChunkRing) else CHECKPOINT_CHUNK_BYTES
        # A unit: (base, first byte, end byte, parts); a part: (tensor, its first byte, base's first, base's end).
        self._units: list[tuple[int, int, int, list]] = []
        if kind.whole_tensors:
            bases, index = [], {}
            for i, tensor in enumerate(tensors):
                base, first = origins[id(tensor)]
                assert base.dtype == tensor.dtype and base.is_contiguous() and tensor.is_contiguous()
                if id(base) not in index:
                    index[id(base)] = len(bases)
                    bases.append(base)
                    self._units.append((index[id(base)], 0, base.numel() * base.element_size(), []))
                offset, nbytes = first * base.element_size(), tensor.numel() * tensor.element_size()
                self._units[index[id(base)]][3].extend(
                    (i, a, offset + a, offset + min(a + chunk, nbytes)) for a in range(0, nbytes, chunk))
        else:
            bases = tensors
            for i, tensor in enumerate(tensors):
                assert tensor.is_contiguous(), "chunks are byte ranges of a tensor"
                nbytes = tensor.numel() * tensor.element_size()
                self._units += [(i, a, min(a + chunk, nbytes), [(i, a, a, min(a + chunk, nbytes))])
                                for a in range(0, nbytes, chunk)]
        self.transfer = kind(bases)
        self._state = [PENDING] * len(self._units)
        self._token: dict[int, int] = {}
        self._data: dict[int, torch.Tensor] = {}
        self._changed = threading.Condition()
        self._closed = False
        self.frozen = False     # freeze() has returned
        self.staged_bytes = 0  # how much freeze() brought into the ring (the rest the writer took itself)
        ring.reset()

    def chunks(self) -> Iterator[tuple[int, int, memoryview]]:
        """(tensor index, first byte, its bytes), each tensor's in order. A chunk's memory is the writer's until it
        asks for the next one (or the generator ends): it must have written and checksummed it by then."""
        in_place = self.transfer.in_place
        for u, (base, start, end, parts) in enumerate(self._units):
            with self._changed:
                while self._state[u] == STAGING:
                    self._changed.wait()
                mine = self._state[u] == PENDING
                if mine:
                    if not in_place:  # room frees as the writer moves on: freeze() only stages units ahead of it
                        while not self.ring.has_room(end - start):
                            self._changed.wait()
                        self._token[u] = self.ring.take(end - start)
                    self._state[u] = LIVE
                token = self._token.get(u)
            try:
                if not mine:
                    data = self._data.pop(u)
                elif in_place:
                    data = self.transfer.live(base, start, end)
                else:
                    data = self.transfer.fetch(base, start, end, self.ring.view(token, end - start))
                    with self._changed:
                        self._state[u] = FETCHED
                        self._changed.notify_all()
                for i, first, a, b in parts:
                    yield i, first, memoryview(data[a - start:b - start].numpy())
            finally:
                data = None
                with self._changed:
                    if token is not None:
                        self.ring.give(token)
                    self._state[u] = DONE
                    self._changed.notify_all()
        self.transfer.release()

    def freeze(self) -> None:
        """Return once no unit will be read from the live tensors again: bring the unwritten ones into the ring,
        wait for the one the writer reads. Returns at once after close() (a failed or finished write)."""
        for u, (base, start, end, _) in enumerate(self._units):
            with self._changed:
                while self._state[u] == PENDING and not self.ring.has_room(end - start) and not self._closed:
                    self._changed.wait()
                if self._closed:
                    break
                if self._state[u] != PENDING:  # the writer has it or is done with it
                    continue
                token = self._token[u] = self.ring.take(end - start)
                self._state[u] = STAGING
            data = self.transfer.fetch(base, start, end, self.ring.view(token, end - start))
            self.staged_bytes += end - start
            with self._changed:
                self._data[u] = data
                self._state[u] = STAGED
                self._changed.notify_all()
        with self._changed:
            while LIVE in self._state and not self._closed:
                self._changed.wait()
        self.transfer.release()
        self.frozen = True

    def close(self) -> None:
        """The writer is done with the snapshot (written, or failed): freeze() has nothing to wait for."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
