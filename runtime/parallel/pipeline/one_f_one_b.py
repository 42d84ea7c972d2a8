# 1F1B (PipeDream-Flush, Megatron's default): rank r runs (pp - r - 1) warm-up forwards, then alternates one
# forward and one backward (steady state), then runs the remaining backwards (cool-down).
#
# Same bubble as all-forward-all-backward, (p - 1) / (m + p - 1) of the time, but rank r holds the activations of
# at most pp - r micro-batches instead of all m.
#
#   pp=4, m=6, rank 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
#              rank 3:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
from __future__ import annotations

from runtime.parallel.pipeline.actions import Action, backward, forward


def one_f_one_b(pp: int, rank: int, num_micro_batches: int) -> list[Action]:
    assert 0 <= rank < pp, (rank, pp)
    m = num_micro_batches
    warmup = min(pp - rank - 1, m)
    actions = [forward(0, i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the forward of micro-batch warmup+i, the backward of i
        actions += [forward(0, warmup + i), backward(0, i)]
    actions += [backward(0, i) for i in range(m - warmup, m)]  # cool-down
    return actions
