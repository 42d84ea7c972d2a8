# Run one rank's schedule (a list of Actions): forward and backward passes of its model chunks, with activations
# received from the previous stage and sent to the next, and their gradients the other way. Each receive is posted
# before the action ahead of its own runs (p2p.receive_posts) and waited for right before its pass uses it.
#
# Loss normalization is train_step's: the last stage hands each micro-batch's per-token losses to the step's
# objective (runtime/step.py TokenMean: sum(loss * mask) / total_tokens, total_tokens counted over the global batch
# before any backward), so gradients match the single-process run however the batch is split. The objective's
# statistics stay on the last stage; the caller reduces them.
from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch

from runtime.micro_batch import PreparedBatch
from runtime.objective import TOKEN_MEAN
from runtime.parallel.pipeline.actions import Action
from runtime.parallel.pipeline.p2p import P2P, RECEIVE_AHEAD, early_receives_from_env, needs_receive, receive_posts
from runtime.parallel.pipeline.stages import PipelineStageModel


class ScheduleRun:
    """State of one schedule run on one rank; `run()` returns this rank's summed objective statistics (for the
    token mean, sum(loss * mask); zeros off the last stage)."""

    def __init__(self, stage: PipelineStageModel, p2p: P2P, batches: Sequence[PreparedBatch],
                 total_tokens: torch.Tensor | Sequence[float], *, forward_only: bool,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 timeline: list | None = None, collect: Callable | None = None, objective: Callable | None = None,
                 early_receives: bool | None = None, events: list | None = None):
        self.stage, self.p2p, self.batches = stage, p2p, batches
        # A tensor (the step's, on the device) or numbers.
        self.totals = (total_tokens if isinstance(total_tokens, (torch.Tensor, list, tuple)) else [total_tokens])
        self.objective = objective or TOKEN_MEAN
        self.forward_only, self.autocast = forward_only, autocast
        self.timeline = timeline  # when a list: (kind, start, end) of each pass's compute, receives excluded
        # Post receives RECEIVE_AHEAD actions early (None: NXDT_PP_EARLY_RECV, on unless "0"), or just in time.
        self.early_receives = early_receives_from_env() if early_receives is None else early_receives
        self.events = events  # when a list: ("post" | "received" | "computed", action), in the order they happen
        first = next(stage.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.loss_sum: torch.Tensor | None = None  # the objective's statistics, summed over micro-batches
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (chunk, mb) -> (in, out)
        self.peak_in_flight = 0  # most micro-batch activations held at once (all chunks)
        # Forward-only scoring: the last stage hands collect(logits, labels) each micro-batch's full-vocabulary
        # logits instead of computing the loss, and keeps what it returns (evaluation's per-token scores).
        self.collect, self.collected = collect, {}

    def activation_shape(self, input_ids: torch.Tensor) -> tuple[int, int, int]:
        batch, seq = input_ids.shape
        if self.stage.sequence_parallel:
            seq //= self.stage.tp_size
        return batch, seq, self.stage.cfg.hidden_size  # (B, T[/tp], H)

    def run(self, actions: Sequence[Action]) -> torch.Tensor:
        needs = needs_receive(actions, self.stage.pp_size, self.stage.pp_rank, self.stage.virtual_pp)
        posts = receive_posts(needs, RECEIVE_AHEAD if self.early_receives else 0)
        try:
            for action, to_post in zip(actions, posts):
                for later in to_post:
                    self._post_receive(actions[later])
                (self._forward if action.kind == "F" else self._backward)(action)
        finally:
            self.p2p.finish()
        assert not self._saved, f"schedule left activations behind: {sorted(self._saved)}"
        assert not self.p2p.posted, f"receives posted but never used: {self.p2p.posted}"
        if self.loss_sum is None:  # not the last stage: zeros, to sum over pp
            self.loss_sum = torch.zeros(self.objective.num_stats, dtype=torch.float32,
                                        device=self.batches[0].input_ids.device)
        return self.loss_sum

    def _post_receive(self, action: Action) -> None:
        """Start receiving the input of a forward or the output gradient of a backward: both (B, T[/tp], H) in
        the parameters' dtype, which _forward asserts every stage sends."""
        shape = self.activation_shape(self.batches[action.micro_batch].input_ids)
        post = self.p2p.post_activation if action.kind == "F" else self.p2p.post_gradient
        post(action, shape, self.dtype, self.device)
        self._note("post", action)

    def _receive(self, action: Action) -> torch.Tensor:
        received = self.p2p.take(action)
        self._note("received", action)
        return received

    def _forward(self, action: Action) -> None:
        chunk_index, micro_batch = action.chunk, action.micro_batch
        chunk = self.stage.chunks[chunk_index]
        batch = self.batches[micro_batch]
        input_ids, labels, layout = batch.input_ids, batch.labels, batch.layout
        if chunk.is_first:
            x = input_ids
        else:
            x = self._receive(action)
            x.requires_grad_(not self.forward_only)
        started = time.perf_counter()
        with self.autocast():
            out = chunk(x, labels if chunk.is_last and self.collect is None else None, layout)
        if chunk.is_last and self.collect is not None:
            self.collected[micro_batch] = self.collect(out, labels)
            self._record(action, started)
            return
        if chunk.is_last:
            out, stats = self.objective(out, batch, self.totals)
            self.loss_sum = stats if self.loss_sum is None else self.loss_sum + stats
        else:
            expected = self.activation_shape(input_ids)
            assert tuple(out.shape) == expected and out.dtype == self.dtype, (
                f"stage {chunk.stage} produced {tuple(out.shape)} {out.dtype}; the next stage expects "
                f"{expected} {self.dtype}")
        self._record(action, started)
        if not chunk.is_last:
            self.p2p.send_activation(out)
        if not self.forward_only:
            self._saved[(chunk_index, micro_batch)] = (None if chunk.is_first else x, out)
            self.peak_in_flight = max(self.peak_in_flight, len(self._saved))

    def _backward(self, action: Action) -> None:
        chunk = self.stage.chunks[action.chunk]
        x, out = self._saved.pop((action.chunk, action.micro_batch))
        grad = None if chunk.is_last else self._receive(action)
        started = time.perf_counter()
        torch.autograd.backward(out, grad)
        self._record(action, started)
        if x is not None:
            self.p2p.send_gradient(x.grad)

    def _record(self, action: Action, started: float) -> None:
        if self.timeline is not None:
            self.timeline.append((action.kind, started, time.perf_counter()))
        self._note("computed", action)

    def _note(self, what: str, action: Action) -> None:
        if self.events is not None:
            self.events.append((what, action))
