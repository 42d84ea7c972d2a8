"""Schedules and stage splitting as pure functions: every schedule is simulated on all ranks at once, with
asynchronous sends and blocking in-order receives as runtime/parallel/pipeline/p2p.py does, to show it
completes (no deadlock), runs each pass exactly once, and that sender and receiver order the messages between
each pair of ranks identically even without tags (so neither tags nor timing decide which message is which)."""
from __future__ import annotations

import collections

import pytest

from runtime.parallel.pipeline import (all_forward_all_backward, forward_only_schedule, interleaved_one_f_one_b,
                                       one_f_one_b, split_layers)


def simulate(actions_per_rank: list[list], pp: int, vpp: int, num_micro_batches: int) -> list[int]:
    """Run every rank's action list; returns each rank's peak number of micro-batches held for backward."""
    stages = pp * vpp
    # One queue per directed pair, whatever the message kind: NCCL matches sends and receives between two ranks in
    # posting order and ignores tags, so the schedules must agree on the order without them (stricter than gloo).
    queues = collections.defaultdict(collections.deque)  # (src, dst) -> deque of (stage, micro_batch)
    position = [0] * pp
    held = [set() for _ in range(pp)]
    peak = [0] * pp
    done = set()
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            if position[rank] == len(actions_per_rank[rank]):
                continue
            kind, chunk, mb = actions_per_rank[rank][position[rank]]
            stage = chunk * pp + rank
            prev_rank, next_rank = (rank - 1) % pp, (rank + 1) % pp
            if kind == "F":
                if stage > 0:
                    queue = queues[(prev_rank, rank)]
                    if not queue:
                        continue  # blocked on a receive
                    assert queue.popleft() == (stage - 1, mb), "the next message on this pair is this activation"
                if stage < stages - 1:
                    queues[(rank, next_rank)].append((stage, mb))
                held[rank].add((chunk, mb))
            else:
                assert (chunk, mb) in held[rank], f"backward before forward: {kind}{chunk}.{mb} on rank {rank}"
                if stage < stages - 1:
                    queue = queues[(next_rank, rank)]
                    if not queue:
                        continue
                    assert queue.popleft() == (stage + 1, mb), "the next message on this pair is this gradient"
                if stage > 0:
                    queues[(rank, prev_rank)].append((stage, mb))
                held[rank].discard((chunk, mb))
            assert (kind, stage, mb) not in done, "each pass runs once"
            done.add((kind, stage, mb))
            peak[rank] = max(peak[rank], len(held[rank]))
            position[rank] += 1
            progress = True
    assert position == [len(a) for a in actions_per_rank], f"deadlock at {position}"
    assert not any(queues.values()), "every message is received"
    return peak


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (4, 2)])
def test_one_f_one_b_completes_and_bounds_activations(pp, m):
    actions = [one_f_one_b(pp, r, m) for r in range(pp)]
    peak = simulate(actions, pp, 1, m)
    assert peak == [min(pp - r, m) for r in range(pp)]  # rank r holds at most pp - r micro-batches
    assert sum(a.kind == "B" for a in actions[0]) == m


def test_one_f_one_b_order():
    assert [repr(a) for a in one_f_one_b(4, 0, 6)] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [repr(a) for a in one_f_one_b(4, 3, 3)] == "F0 B0 F1 B1 F2 B2".split()


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_all_forward_all_backward_holds_every_micro_batch(pp, m):
    assert simulate([all_forward_all_backward(pp, r, m) for r in range(pp)], pp, 1, m) == [m] * pp


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 2, 6)])
def test_interleaved_completes(pp, vpp, m):
    actions = [interleaved_one_f_one_b(pp, r, m, vpp) for r in range(pp)]
    simulate(actions, pp, vpp, m)
    assert all(len(a) == 2 * m * vpp for a in actions)


def test_interleaved_needs_micro_batches_multiple_of_pp():
    with pytest.raises(ValueError, match=r"to be a multiple of pipeline_model_parallel_size \(4\)"):
        interleaved_one_f_one_b(4, 0, 6, 2)


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 3), (2, 2, 3), (4, 2, 5)])
def test_forward_only_completes(pp, vpp, m):
    actions = [forward_only_schedule(pp, r, m, vpp) for r in range(pp)]
    # Forward-only holds nothing for backward, but the simulation checks message order and completion the same way.
    simulate(actions, pp, vpp, m)


def test_split_layers_even_uneven_and_too_few():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]  # extra layers to the earliest stages
    with pytest.raises(ValueError, match="model.num_layers: 3 is fewer than the pipeline stages"):
        split_layers(3, 4)
    # NxD Training's pipeline_cuts for Llama 3 70B on trn2 (model.layers.18, .39, .60): 19, 21, 21, 19 layers.
    assert [len(r) for r in split_layers(80, 4, (18, 39, 60))] == [19, 21, 21, 19]
    for bad in ((18, 39), (39, 18, 60), (18, 39, 79)):
        with pytest.raises(ValueError, match=r"model.pipeline_cuts: .* must be 3 increasing layer indices below 79"):
            split_layers(80, 4, bad)
