# GPipe's schedule: every micro-batch forward, then every micro-batch backward. The simplest pipelined schedule,
# with the same bubble as 1F1B but activations of all m micro-batches alive at once; kept as the baseline that
# benchmarks/pipeline.py measures 1F1B against.
from __future__ import annotations

from runtime.parallel.pipeline.actions import Action, backward, forward


def all_forward_all_backward(pp: int, rank: int, num_micro_batches: int) -> list[Action]:
    assert 0 <= rank < pp, (rank, pp)
    m = num_micro_batches
    return [forward(0, i) for i in range(m)] + [backward(0, i) for i in range(m)]
