# Forward-only schedule for validation and evaluation: no backward, no stored activations. Every rank runs its
# chunks in order, all micro-batches through chunk 0, then all through chunk 1, ...; with virtual stages a
# micro-batch's chunk v on rank 0 waits for chunk v - 1 on the last rank, which that order always reaches first.
from __future__ import annotations

from runtime.parallel.pipeline.actions import Action, forward


def forward_only(pp: int, rank: int, num_micro_batches: int, vpp: int = 1) -> list[Action]:
    assert 0 <= rank < pp and vpp >= 1, (rank, pp, vpp)
    return [forward(chunk, i) for chunk in range(vpp) for i in range(num_micro_batches)]
