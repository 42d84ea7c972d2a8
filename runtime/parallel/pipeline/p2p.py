# Point-to-point exchange of activations (forward) and their gradients (backward) between neighbouring pipeline
# ranks, through the collectives module's send/start_recv (isend/irecv, which gloo, nccl and xla implement, staged
# through host memory where the backend needs it, as every collective is).
#
# Sends are asynchronous and only waited for at the end of a schedule (or when they are found complete), so a
# rank never blocks on a neighbour that is itself waiting to receive: with that, any schedule whose per-rank order
# respects the data dependencies is deadlock free. Receives are posted early and waited for late: before running
# action k the executor posts the receives of actions k .. k + RECEIVE_AHEAD (receive_posts), so the next pass's
# input moves while this pass computes, and waits for a receive only right before its pass uses it. Activations
# and gradients travel with different tags; messages of one kind between one pair of ranks arrive in the order
# sent, which every schedule here keeps (sender and receiver enumerate micro-batches in the same order), and
# receives are posted in the receiver's action order, so the posted receives of each (peer, tag) line up with the
# peer's sends in order.
#
# Posting ahead is gloo's: on a backend that runs each pair's sends and receives in posting order (NCCL) a receive
# posted ahead of a send can deadlock the pair, so collectives.start_recv posts there only when waited for (see
# tests/runtime_pipeline/test_early_receives.py for both, simulated on every schedule).
#
# NXDT_PP_EARLY_RECV=0 turns early posting off (each receive is posted right before it is waited for, as before);
# the default is 1. The arithmetic is the same either way, so losses and weights are bitwise identical.
from __future__ import annotations

import os
from typing import Callable, Hashable, Sequence

import torch

from runtime.parallel import collectives as C
from runtime.parallel.pipeline.actions import Action

ACTIVATION_TAG = 0
GRADIENT_TAG = 1
# How many actions ahead a receive is posted. One is enough to move a pass's input while the pass before it runs;
# each further one holds another activation-sized buffer before its message is even sent (in 1F1B the neighbour
# sends it at the end of its own matching pass), and posting a whole schedule's receives up front would hold as
# many buffers as all-forward-all-backward holds activations, undoing 1F1B's memory bound.
RECEIVE_AHEAD = 1
EARLY_RECEIVES_ENV = "NXDT_PP_EARLY_RECV"


def early_receives_from_env() -> bool:
    """NXDT_PP_EARLY_RECV: "1" (the default) posts receives ahead, "0" right before they are waited for."""
    value = os.environ.get(EARLY_RECEIVES_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{EARLY_RECEIVES_ENV}={value!r} is not one of ['0', '1']")
    return value == "1"


def needs_receive(actions: Sequence[Action], pp: int, rank: int, vpp: int) -> list[bool]:
    """Whether each action starts with a receive: a forward on any global stage but the first (its input), a
    backward on any but the last (its output's gradient). Chunk v of pp rank r is global stage v * pp + r."""
    last = pp * vpp - 1
    return [(a.chunk * pp + rank > 0) if a.kind == "F" else (a.chunk * pp + rank < last) for a in actions]


def receive_posts(needs: Sequence[bool], ahead: int) -> list[list[int]]:
    """For each action k, the actions whose receives to post right before running it: those of k .. k + ahead
    that need one and are not posted yet, in action order. ahead=0 posts each receive just before its own action."""
    posts, posted = [], 0  # every action before `posted` has had its receive posted (if it needs one)
    for k in range(len(needs)):
        end = min(k + ahead + 1, len(needs))
        posts.append([j for j in range(posted, end) if needs[j]])
        posted = max(posted, end)
    return posts


class P2P:
    """This rank's sends and receives within its pipeline group (global ranks of the neighbours). A receive is
    posted under a key (the executor's action) and taken by it."""

    def __init__(self, prev_rank: int, next_rank: int):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self._pending: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive until sent)
        self._posted: dict[Hashable, Callable[[], torch.Tensor]] = {}  # key -> wait(); holds the buffer alive

    def send(self, tensor: torch.Tensor, to_next: bool, tag: int) -> None:
        work, kept = C.send(tensor.detach().contiguous(), self.next_rank if to_next else self.prev_rank, tag)
        self._pending.append((work, kept))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def post(self, key: Hashable, shape, dtype: torch.dtype, device: torch.device, from_prev: bool, tag: int) -> None:
        """Start receiving a tensor of `shape` from the previous (or next) rank; take(key) waits for it."""
        assert key not in self._posted, f"a receive for {key} is already posted"
        out = torch.empty(shape, dtype=dtype, device=device)
        self._posted[key] = C.start_recv(out, self.prev_rank if from_prev else self.next_rank, tag)

    def take(self, key: Hashable) -> torch.Tensor:
        """Wait for the receive posted under `key`; returns its tensor."""
        assert key in self._posted, f"no receive posted for {key}"
        return self._posted.pop(key)()

    def post_activation(self, key: Hashable, shape, dtype, device) -> None:
        self.post(key, shape, dtype, device, from_prev=True, tag=ACTIVATION_TAG)

    def send_activation(self, tensor: torch.Tensor) -> None:
        self.send(tensor, to_next=True, tag=ACTIVATION_TAG)

    def post_gradient(self, key: Hashable, shape, dtype, device) -> None:
        self.post(key, shape, dtype, device, from_prev=False, tag=GRADIENT_TAG)

    def send_gradient(self, tensor: torch.Tensor) -> None:
        self.send(tensor, to_next=False, tag=GRADIENT_TAG)

    def finish(self) -> None:
        """Wait for every outstanding send (end of a schedule: the buffers may then be reused)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    @property
    def posted(self) -> list:
        """Keys of the receives posted and not yet taken."""
        return list(self._posted)
