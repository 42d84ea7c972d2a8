# What a schedule is: for one pp rank, the ordered list of forward and backward passes it runs, each naming a
# model chunk (virtual stage index on this rank) and a micro-batch. Schedules are pure functions of
# (pp size, pp rank, micro-batches, virtual stages), so they are testable without processes.
from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str         # "F" (forward) or "B" (backward)
    chunk: int        # which of this rank's model chunks (0 without virtual stages)
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def forward(chunk: int, micro_batch: int) -> Action:
    return Action("F", chunk, micro_batch)


def backward(chunk: int, micro_batch: int) -> Action:
    return Action("B", chunk, micro_batch)
