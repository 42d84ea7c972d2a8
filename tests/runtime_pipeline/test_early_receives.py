"""Early receives (runtime/parallel/pipeline/p2p.py): each receive is posted one action ahead and waited for right
before its pass uses it.

Without processes: every schedule simulated with posted receives matched as gloo matches them (by peer and tag,
in posting order, independently of sends) completes and hands each pass its own message; the same plan on a
backend that runs each pair's operations in posting order (NCCL's stream per pair) deadlocks, which is why
collectives.start_recv posts early on gloo only. In two and four gloo processes: the receives are posted before
the pass ahead of theirs computes (and only just in time with NXDT_PP_EARLY_RECV=0), and training with early
receives on and off gives bitwise-identical losses, grad norms and weights, for 1F1B and interleaved 1F1B.
"""
from __future__ import annotations

import collections
import os
import time

import pytest
import torch
import torch.distributed as dist

from runtime.micro_batch import MicroBatch
from runtime.models import build_model
from runtime.parallel import ParallelDims, Topology, parallelize_model
from runtime.parallel import collectives as C
from runtime.parallel.pipeline import (all_forward_all_backward, forward_only_schedule, interleaved_one_f_one_b,
                                       one_f_one_b, run_pipeline)
from runtime.parallel.pipeline.p2p import EARLY_RECEIVES_ENV, RECEIVE_AHEAD, needs_receive, receive_posts
from runtime.parallel.topology import use_host_staging
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_pipeline import harness as P

L = P.PipelineLayout


# ------------------------------------------------------------------------------------------------- the plan
def test_receive_posts_one_action_ahead_in_action_order():
    needs = [False, True, False, True, True, False, True]
    assert receive_posts(needs, 0) == [[], [1], [], [3], [4], [], [6]]  # just in time
    assert receive_posts(needs, 1) == [[1], [], [3], [4], [], [6], []]  # before the action ahead of theirs
    assert receive_posts(needs, len(needs)) == [[1, 3, 4, 6], [], [], [], [], [], []]  # all up front


def test_needs_receive_follows_the_global_stage():
    # pp=2, vpp=2, rank 0 holds stages 0 and 2 (of 4): stage 0 receives no input, every stage but 3 a gradient.
    actions = interleaved_one_f_one_b(2, 0, 2, 2)
    assert [repr(a) for a in actions] == "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1".split()
    assert needs_receive(actions, 2, 0, 2) == [False, False, True, True, True, True, True, True]
    assert needs_receive(one_f_one_b(2, 1, 2), 2, 1, 1) == [True, False, True, False]  # last stage: inputs only


# --------------------------------------------------------------------------------------- simulated backends
def simulate_posted(actions_per_rank: list[list], pp: int, vpp: int, ahead: int, in_posting_order: bool) -> bool:
    """Run every rank's actions with receives posted by receive_posts(ahead); sends never block the host. Returns
    whether every rank finishes. gloo (in_posting_order=False): a receive matches the next message of its (peer,
    tag), whatever else is posted. NCCL (True): each pair's sends and receives run one after another in posting
    order, tags ignored, so a posted receive holds back every later send to that peer until its message comes."""
    stages = pp * vpp
    channels = collections.defaultdict(collections.deque)  # in flight: (src, dst[, tag]) -> messages
    queues = collections.defaultdict(collections.deque)    # posted, not yet run: per pair, or per (peer, tag) recv
    received: dict[tuple[int, int], tuple] = {}           # (rank, action index) -> message
    needs = [needs_receive(actions, pp, rank, vpp) for rank, actions in enumerate(actions_per_rank)]
    steps = []  # per rank: ("post", j) and ("run", k), in the order the executor does them
    for rank, actions in enumerate(actions_per_rank):
        posts = receive_posts(needs[rank], ahead)
        steps.append([step for k in range(len(actions)) for step in (*(("post", j) for j in posts[k]), ("run", k))])
    position = [0] * pp

    def peer_and_tag(rank, kind, sending):
        forward = kind == "F"
        to_next = forward if sending else not forward  # activations go forward, gradients back
        return ((rank + 1) % pp if to_next else (rank - 1) % pp), (0 if forward else 1)

    def channel(src, dst, tag):
        return channels[(src, dst) if in_posting_order else (src, dst, tag)]

    def run_queues() -> bool:
        moved = False
        for key, queue in list(queues.items()):
            while queue:
                op = queue[0]
                if op[0] == "send":
                    _, src, dst, tag, message = op
                    channel(src, dst, tag).append(message)
                else:
                    _, rank, src, tag, index = op
                    if not channel(src, rank, tag):
                        break
                    received[(rank, index)] = channel(src, rank, tag).popleft()
                queue.popleft()
                moved = True
        return moved

    progress = True
    while progress:
        progress = run_queues()
        for rank in range(pp):
            while position[rank] < len(steps[rank]):
                step, index = steps[rank][position[rank]]
                kind, chunk, mb = actions_per_rank[rank][index]
                stage = chunk * pp + rank
                if step == "post":
                    src, tag = peer_and_tag(rank, kind, sending=False)
                    queues[(rank, src) if in_posting_order else (rank, src, tag)].append(
                        ("recv", rank, src, tag, index))
                else:
                    if needs[rank][index]:
                        if (rank, index) not in received:
                            break  # waiting for the message
                        expected = ("F", stage - 1, mb) if kind == "F" else ("B", stage + 1, mb)
                        assert received.pop((rank, index)) == expected, "each pass gets its own message"
                    if (kind == "F" and stage < stages - 1) or (kind == "B" and stage > 0):
                        dst, tag = peer_and_tag(rank, kind, sending=True)
                        op = ("send", rank, dst, tag, (kind, stage, mb))
                        if in_posting_order:
                            queues[(rank, dst)].append(op)
                        else:
                            channel(rank, dst, tag).append(op[-1])
                position[rank] += 1
                progress = True
    finished = position == [len(s) for s in steps]
    if finished:
        assert not any(queues.values()) and not any(channels.values()) and not received
    return finished


SCHEDULES = {
    "1f1b pp2": ([one_f_one_b(2, r, 4) for r in range(2)], 2, 1),
    "1f1b pp4": ([one_f_one_b(4, r, 8) for r in range(4)], 4, 1),
    "1f1b pp3 m2": ([one_f_one_b(3, r, 2) for r in range(3)], 3, 1),
    "afab pp4": ([all_forward_all_backward(4, r, 4) for r in range(4)], 4, 1),
    "interleaved pp2 vpp2": ([interleaved_one_f_one_b(2, r, 4, 2) for r in range(2)], 2, 2),
    "interleaved pp2 vpp3": ([interleaved_one_f_one_b(2, r, 6, 3) for r in range(2)], 2, 3),
    "interleaved pp4 vpp2": ([interleaved_one_f_one_b(4, r, 8, 2) for r in range(4)], 4, 2),
    "forward-only pp4 vpp2": ([forward_only_schedule(4, r, 5, 2) for r in range(4)], 4, 2),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("ahead", [0, RECEIVE_AHEAD, 3, 10 ** 6])
def test_posted_receives_complete_every_schedule_on_gloo(name, ahead):
    actions, pp, vpp = SCHEDULES[name]
    assert simulate_posted(actions, pp, vpp, ahead, in_posting_order=False)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_just_in_time_receives_complete_every_schedule_in_posting_order(name):
    actions, pp, vpp = SCHEDULES[name]
    assert simulate_posted(actions, pp, vpp, 0, in_posting_order=True)


def test_receives_posted_ahead_deadlock_a_backend_that_runs_each_pair_in_posting_order():
    """pp=2 1F1B: rank 0 posts B0's receive before F1 sends, rank 1 posts F1's before B0 sends: each pair's
    stream then waits on a receive that only the send queued behind the other's receive would satisfy. So
    collectives.start_recv posts early only on gloo; elsewhere it posts when waited for (the ahead=0 plan)."""
    actions, pp, vpp = SCHEDULES["1f1b pp2"]
    assert not simulate_posted(actions, pp, vpp, RECEIVE_AHEAD, in_posting_order=True)


# ------------------------------------------------------------------------------------------- gloo processes
def _pipeline_events(pp: int, vpp: int, early: bool) -> list:
    """One training pass of a tiny GPT through run_pipeline; the executor's (event, action) list."""
    cfg = H.tiny_config("gpt", num_layers=pp * vpp)
    topo = Topology.build(ParallelDims(tp=1, pp=pp, dp=1, world_size=dist.get_world_size()))
    stage = parallelize_model(build_model(cfg), topo, virtual_pp=vpp if vpp > 1 else None)
    batches = [MicroBatch.of(b).prepare() for b in H.micro_batches_for(0, cfg.vocab_size, topo)]  # 4 of them
    events: list = []
    total = float(sum(batch.loss_mask.sum() for batch in batches))
    run_pipeline(stage, batches, topo, total, forward_only=False, early_receives=early, events=events)
    return events


def _staged_receive() -> tuple | None:
    """Rank 0 sends to rank 1, which receives through a host buffer: `out` before and after wait()."""
    if dist.get_rank() == 0:
        work, _kept = C.send(torch.arange(4.0), 1, tag=7)
        work.wait()
        dist.barrier()
        return None
    out = torch.full((4,), -1.0)
    wait = C.start_recv(out, 0, tag=7)
    dist.barrier()  # the message is sent (most likely already in the host buffer)
    time.sleep(0.1)
    before = out.clone()
    return before, wait().clone()


def _staged(fn, *args):
    """fn(*args) with every collective staged through host memory, as gloo over XLA tensors is."""
    use_host_staging(lambda tensor, backend: True)
    try:
        return fn(*args)
    finally:
        use_host_staging(lambda tensor, backend: False)


# Two steps: a receive matched to the wrong message changes the first step's numbers already, and the second
# runs from the first's weights and Adam state, as every later one would.
STEPS = 2


def _suite(pp: int, jobs: dict) -> dict:
    events = {(vpp, early): _pipeline_events(pp, vpp, early) for vpp in (1, 2) for early in (True, False)}
    trained = {}
    for early in ("1", "0"):  # through the environment, as a plain training run would be switched
        os.environ[EARLY_RECEIVES_ENV] = early
        try:
            trained.update({(name, early): P.train(arch, overrides, layout, steps=STEPS)
                            for name, (arch, overrides, layout) in jobs.items()})
            if pp == 2:
                arch, overrides, layout = jobs["gpt-pp2"]
                trained[("gpt-pp2-staged", early)] = _staged(P.train, arch, overrides, layout, STEPS)
        finally:
            del os.environ[EARLY_RECEIVES_ENV]
    staged_receive = _staged(_staged_receive) if pp == 2 else None
    return {"events": events, "trained": trained, "staged_receive": staged_receive}


TWO_RANK_JOBS = {"gpt-pp2": ("gpt", {}, L(pp=2)), "llama-pp2-vpp2": ("llama", {}, L(pp=2, vpp=2))}
FOUR_RANK_JOBS = {"gpt-pp4": ("gpt", {}, L(pp=4)), "llama-pp4-vpp2": ("llama", {"num_layers": 8}, L(pp=4, vpp=2))}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_suite, 2, args=(2, TWO_RANK_JOBS))


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_suite, 4, args=(4, FOUR_RANK_JOBS))


def _order(events: list) -> dict:
    return {event: index for index, event in enumerate(events)}


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
@pytest.mark.parametrize("vpp", [1, 2])
def test_receives_are_posted_before_the_pass_ahead_of_theirs_computes(ranks, vpp, request):
    for rank in request.getfixturevalue(ranks):
        events = rank["events"][(vpp, True)]
        order = _order(events)
        actions = [a for what, a in events if what == "computed"]
        assert sum(what == "post" for what, _ in events) > 0
        for k, action in enumerate(actions):
            if ("post", action) not in order:
                continue  # nothing to receive
            assert order[("post", action)] < order[("received", action)] < order[("computed", action)]
            if k > 0:  # posted while the action ahead still had its compute to run
                assert order[("post", action)] < order[("computed", actions[k - 1])], (action, events)


def test_the_last_stage_posts_the_next_micro_batch_before_this_one_finishes(two_ranks):
    """1F1B, pp=2, rank 1: F0 B0 F1 B1 ...; micro-batch i+1's activation is posted before B(i) computes."""
    order = _order(two_ranks[1]["events"][(1, True)])
    for i in range(3):
        assert order[("post", ("F", 0, i + 1))] < order[("computed", ("B", 0, i))]


@pytest.mark.parametrize("vpp", [1, 2])
def test_with_early_receives_off_each_receive_is_posted_just_in_time(vpp, two_ranks):
    for rank in two_ranks:
        events = rank["events"][(vpp, False)]
        for index, (what, action) in enumerate(events):
            if what == "post":
                assert events[index + 1] == ("received", action), "posted right before it is waited for"


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    assert a["eval_loss"] == b["eval_loss"]
    assert a["state"].keys() == b["state"].keys()
    for key, value in a["state"].items():
        assert torch.equal(value, b["state"][key]), key


@pytest.mark.parametrize("ranks, name", [("two_ranks", n) for n in TWO_RANK_JOBS] +
                         [("four_ranks", n) for n in FOUR_RANK_JOBS])
def test_early_receives_on_and_off_train_bitwise_identically(ranks, name, request):
    for rank in request.getfixturevalue(ranks):
        _assert_bitwise_equal(rank["trained"][(name, "1")], rank["trained"][(name, "0")])


def test_receives_staged_through_host_memory_train_bitwise_identically(two_ranks):
    """Every collective through host copies (gloo over XLA tensors): the posted receive lands in a host buffer
    and is copied to the tensor in wait()."""
    for rank in two_ranks:
        for early in ("1", "0"):
            _assert_bitwise_equal(rank["trained"][("gpt-pp2-staged", early)], rank["trained"][("gpt-pp2", early)])


def test_a_staged_receive_reaches_its_tensor_only_in_wait(two_ranks):
    before, after = two_ranks[1]["staged_receive"]
    assert torch.equal(before, torch.full((4,), -1.0))
    assert torch.equal(after, torch.arange(4.0))
