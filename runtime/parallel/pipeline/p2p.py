# Point-to-point exchange of activations (forward) and their gradients (backward) between neighbouring pipeline
# ranks, through the collectives module's send/recv (isend/irecv, which gloo, nccl and xla implement, staged
# through host memory where the backend needs it, as every collective is).
#
# Sends are asynchronous and only waited for at the end of a schedule (or when they are found complete), so a
# rank never blocks on a neighbour that is itself waiting to receive: with that, any schedule whose per-rank order
# respects the data dependencies is deadlock free. Receives block until the tensor is there. Activations and
# gradients travel with different tags; messages of one kind between one pair of ranks arrive in the order sent,
# which every schedule here keeps (sender and receiver enumerate micro-batches in the same order).
from __future__ import annotations

import torch

from runtime.parallel import collectives as C

ACTIVATION_TAG = 0
GRADIENT_TAG = 1


class P2P:
    """This rank's sends and receives within its pipeline group (global ranks of the neighbours)."""

    def __init__(self, prev_rank: int, next_rank: int):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self._pending: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive until sent)

    def send(self, tensor: torch.Tensor, to_next: bool, tag: int) -> None:
        work, kept = C.send(tensor.detach().contiguous(), self.next_rank if to_next else self.prev_rank, tag)
        self._pending.append((work, kept))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv(self, shape, dtype: torch.dtype, device: torch.device, from_prev: bool, tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        return C.recv(out, self.prev_rank if from_prev else self.next_rank, tag)

    def send_activation(self, tensor: torch.Tensor) -> None:
        self.send(tensor, to_next=True, tag=ACTIVATION_TAG)

    def recv_activation(self, shape, dtype, device) -> torch.Tensor:
        return self.recv(shape, dtype, device, from_prev=True, tag=ACTIVATION_TAG)

    def send_gradient(self, tensor: torch.Tensor) -> None:
        self.send(tensor, to_next=False, tag=GRADIENT_TAG)

    def recv_gradient(self, shape, dtype, device) -> torch.Tensor:
        return self.recv(shape, dtype, device, from_prev=False, tag=GRADIENT_TAG)

    def finish(self) -> None:
        """Wait for every outstanding send (end of a schedule: the buffers may then be reused)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
