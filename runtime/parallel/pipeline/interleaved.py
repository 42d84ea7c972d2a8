# Interleaved 1F1B (Megatron's virtual pipeline, Narayanan et al. 2021): each rank holds `vpp` model chunks
# (chunk v of rank r is global stage v * pp + r), so a micro-batch goes round the ranks vpp times. The bubble
# shrinks by vpp, to (p - 1) / (vpp * m + p - 1), for vpp times more point-to-point traffic.
#
# Work is enumerated in "virtual micro-steps" k = 0 .. m * vpp - 1, in groups of pp micro-batches:
#   forward k:  chunk (k // pp) % vpp,            micro-batch (k // (pp * vpp)) * pp + k % pp
#   backward k: chunk vpp - 1 - (k // pp) % vpp,  the same micro-batch
# i.e. a group of pp micro-batches runs through chunk 0, then chunk 1, ... (backward: the last chunk first).
# Rank r warms up with (pp - r - 1) * 2 + (vpp - 1) * pp forwards, then alternates forward k + warmup and
# backward k, then cools down. Needs m to be a multiple of pp (as Megatron does).
from __future__ import annotations

from runtime.schema import rules

from runtime.parallel.pipeline.actions import Action, backward, forward


def check_interleaved(pp: int, num_micro_batches: int) -> None:
    if problem := rules.interleaved_micro_batches(num_micro_batches, pp, "training."):
        raise ValueError(problem)


def virtual_step(k: int, pp: int, vpp: int, is_forward: bool) -> tuple[int, int]:
    """(chunk, micro_batch) of virtual micro-step k."""
    chunk = (k // pp) % vpp
    if not is_forward:
        chunk = vpp - 1 - chunk
    return chunk, (k // (pp * vpp)) * pp + k % pp


def interleaved_one_f_one_b(pp: int, rank: int, num_micro_batches: int, vpp: int) -> list[Action]:
    assert 0 <= rank < pp and vpp >= 1, (rank, pp, vpp)
    check_interleaved(pp, num_micro_batches)
    total = num_micro_batches * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    actions = [forward(*virtual_step(k, pp, vpp, True)) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(*virtual_step(k + warmup, pp, vpp, True)), backward(*virtual_step(k, pp, vpp, False))]
    actions += [backward(*virtual_step(k, pp, vpp, False)) for k in range(total - warmup, total)]
    return actions
