"""Log-likelihood of continuations given contexts, batched through one narrow seam to the model.

The model is reached only through a `LogprobFn`, so this file never knows how (or how parallel) it runs:

    forward_logprobs(input_ids (B, T), targets (B, T[, K])) -> (logprobs (B, T[, K]) float32, is_argmax (same) bool)

Position t scores targets[b, t] (each of its K candidates) given input_ids[b, :t+1]. For a request (context,
continuation) the token row is context + continuation, inputs = row[:-1] and targets = row[1:], so the
continuation occupies the last len(continuation) target positions. Rows are right-padded with 0: a causal model
never lets padding at the end influence earlier positions, and those positions are never read back.

Requests whose inputs are the same (the whole row but its last token: the one-token answers " A" .. " D" of a
multiple-choice question) share one row and one forward pass, each its own candidate at the last position, as
lm-eval's hf backend shares its logits (its logits cache): a question costs one pass, not one per answer.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LogprobFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_PAD_ID = 0


def _window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> list[int]:
    """context + continuation, left-truncated to max_length + 1 tokens (max_length predictions)."""
    if not context:
        raise ValueError("loglikelihood: a request has an empty context; the first continuation token needs "
                         "at least one token before it (e.g. an end-of-text token)")
    if len(continuation) > max_length:
        raise ValueError(f"loglikelihood: a continuation of {len(continuation)} tokens does not fit "
                         f"max_length={max_length} (at least one context token must precede it)")
    return (list(context) + list(continuation))[-(max_length + 1):]


def loglikelihood(requests: list[tuple[list[int], list[int]]], forward_logprobs: LogprobFn, *,
                  max_length: int, batch_size: int,
                  progress: Callable[[int, int], None] | None = None,
                  owns: Callable[[int], bool] | None = None) -> list[tuple[float, bool] | None]:
    """For each (context, continuation): (sum of log p(continuation | context), every token greedy).

    Deterministic for a deterministic model: requests are sorted longest first (ties by position) so that
    each batch pads little, and results come back in the order of `requests`.

    owns(k): whether this caller computes the k-th batch of that order (data-parallel ranks share the batches);
    the requests of a batch it does not own come back as None.
    """
    if max_length < 1:
        raise ValueError(f"loglikelihood: max_length must be >= 1, got {max_length}")
    if batch_size < 1:
        raise ValueError(f"loglikelihood: batch_size must be >= 1, got {batch_size}")
    rows = [_window(context, continuation, max_length) for context, continuation in requests]
    shared: dict[tuple[int, ...], list[int]] = {}  # the model's inputs -> the requests they score
    results: list[tuple[float, bool] | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        if not requests[i][1]:  # nothing to score: log 1, and greedy, as lm-eval's hf backend has it
            results[i] = (0.0, True)
            continue
        shared.setdefault(tuple(row[:-1]), []).append(i)
    units = sorted(shared.values(), key=lambda members: (-len(rows[members[0]]), members[0]))

    for number, start in enumerate(range(0, len(units), batch_size)):
        if owns is not None and not owns(number):
            continue
        chunk = units[start:start + batch_size]
        width = len(rows[chunk[0][0]]) - 1  # longest first, so the first row sets the width
        candidates = max(len(members) for members in chunk)
        inputs = torch.full((len(chunk), width), _PAD_ID, dtype=torch.long)  # (B, T)
        targets = torch.full((len(chunk), width, candidates), _PAD_ID, dtype=torch.long)  # (B, T, K)
        for b, members in enumerate(chunk):
            row = torch.tensor(rows[members[0]], dtype=torch.long)
            inputs[b, :len(row) - 1] = row[:-1]
            targets[b, :len(row) - 1] = row[1:, None]
            for k, i in enumerate(members):  # the rest of K repeats the first: read by nobody
                targets[b, len(row) - 2, k] = rows[i][-1]
        shape = (len(chunk), width) if candidates == 1 else (len(chunk), width, candidates)
        logprobs, is_argmax = forward_logprobs(inputs, targets.reshape(shape))
        if tuple(logprobs.shape) != shape or tuple(is_argmax.shape) != shape:
            raise ValueError(f"loglikelihood: forward_logprobs returned shapes {tuple(logprobs.shape)} and "
                             f"{tuple(is_argmax.shape)} for targets of shape {shape}")
        # Summing in float64 keeps a long continuation's total independent of how it was batched.
        logprobs = logprobs.detach().to("cpu", torch.float64).reshape(len(chunk), width, candidates)
        is_argmax = is_argmax.detach().to("cpu", torch.bool).reshape(len(chunk), width, candidates)
        for b, members in enumerate(chunk):
            end = len(rows[members[0]]) - 1
            for k, i in enumerate(members):
                span = slice(end - len(requests[i][1]), end)
                results[i] = (float(logprobs[b, span, k].sum()), bool(is_argmax[b, span, k].all()))
        if progress is not None:  # in requests, however many share a row
            progress(sum(map(len, units[:start + batch_size])), len(rows))
    return results
