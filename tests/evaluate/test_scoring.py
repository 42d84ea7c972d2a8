"""loglikelihood against a bigram "model" whose answers the test computes by hand, token by token."""
import math

import pytest
import torch

from runtime.evaluate.scoring import loglikelihood

VOCAB = 11


def bigram_table(seed: int = 0) -> torch.Tensor:
    """log p(next | previous) as a (VOCAB, VOCAB) table; random logits, so no ties."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.log_softmax(logits, dim=-1)


def bigram_forward(table: torch.Tensor):
    def forward_logprobs(input_ids, targets):  # targets (B, T) or (B, T, K): K candidates per position
        rows = table[input_ids]  # (B, T, V)
        index = targets if targets.dim() == 3 else targets.unsqueeze(-1)
        logprobs, greedy = rows.gather(-1, index).float(), rows.argmax(-1, keepdim=True) == index
        return (logprobs, greedy) if targets.dim() == 3 else (logprobs.squeeze(-1), greedy.squeeze(-1))
    return forward_logprobs


def by_hand(table: torch.Tensor, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    total, greedy, previous = 0.0, True, context[-1]
    for token in continuation:
        total += float(table[previous, token].float())
        greedy &= int(table[previous].argmax()) == token
        previous = token
    return total, greedy


REQUESTS = [
    ([1, 2, 3], [4]),
    ([5], [6, 7, 8, 9]),
    ([2, 2, 2, 2, 2, 2], [2, 2]),
    ([10, 0], [3, 1]),
    ([7, 7, 1], [0]),
]


def test_sums_and_greedy_flags_match_a_hand_computation():
    table = bigram_table()
    got = loglikelihood(REQUESTS, bigram_forward(table), max_length=16, batch_size=2)
    for (context, continuation), (loglik, greedy) in zip(REQUESTS, got):
        want_loglik, want_greedy = by_hand(table, context, continuation)
        assert loglik == pytest.approx(want_loglik, abs=1e-5)
        assert greedy == want_greedy


def test_a_greedy_continuation_is_flagged():
    table = bigram_table()
    continuation, previous = [], 3
    for _ in range(4):  # follow the argmax chain from token 3
        previous = int(table[previous].argmax())
        continuation.append(previous)
    [(loglik, greedy)] = loglikelihood([([3], continuation)], bigram_forward(table), max_length=8, batch_size=1)
    assert greedy
    assert loglik == pytest.approx(by_hand(table, [3], continuation)[0], abs=1e-5)
    [(_, greedy)] = loglikelihood([([3], continuation[:-1] + [(continuation[-1] + 1) % VOCAB])],
                                  bigram_forward(table), max_length=8, batch_size=1)
    assert not greedy


@pytest.mark.parametrize("batch_size", [1, 3, 100])
def test_batch_size_does_not_change_results_or_their_order(batch_size):
    forward = bigram_forward(bigram_table(1))
    reference = loglikelihood(REQUESTS, forward, max_length=16, batch_size=1)
    assert loglikelihood(REQUESTS, forward, max_length=16, batch_size=batch_size) == reference


def test_requests_with_the_same_inputs_share_one_row_of_one_forward_pass():
    table = bigram_table(2)
    forward, rows = bigram_forward(table), []

    def counting(input_ids, targets):
        rows.append(input_ids.shape[0])
        return forward(input_ids, targets)

    # Three one-token answers to one question; a two-token answer and two one-token ones with the same inputs.
    requests = [([1, 2, 3], [4]), ([1, 2, 3], [5]), ([1, 2, 3], [6]), ([7], [8, 9]), ([7, 8], [9]), ([7, 8], [2]),
                ([5], [6, 7, 8])]
    got = loglikelihood(requests, counting, max_length=16, batch_size=8)
    assert rows == [3]  # [1, 2, 3], [7, 8] and [5, 6, 7]: one row each, in one pass
    for (context, continuation), (loglik, greedy) in zip(requests, got, strict=True):
        want_loglik, want_greedy = by_hand(table, context, continuation)
        assert loglik == pytest.approx(want_loglik, abs=1e-5) and greedy == want_greedy


def test_rows_are_left_truncated_and_right_padded():
    seen = []

    def recording(input_ids, targets):
        seen.append((input_ids.clone(), targets.clone()))
        return torch.zeros(input_ids.shape), torch.ones(input_ids.shape, dtype=torch.bool)

    requests = [([1, 2, 3, 4, 5, 6], [7, 8]), ([9], [10])]
    loglikelihood(requests, recording, max_length=4, batch_size=2)
    [(inputs, targets)] = seen
    # Row 0 keeps its last 5 tokens [4, 5, 6, 7, 8]; row 1 is [9, 10] padded to width 4.
    assert inputs.tolist() == [[4, 5, 6, 7], [9, 0, 0, 0]]
    assert targets.tolist() == [[5, 6, 7, 8], [10, 0, 0, 0]]


def test_truncation_keeps_the_continuation_score():
    table = bigram_table()
    long_context = [1, 5, 3, 9, 2, 8, 4, 4, 6, 0, 3]
    [(loglik, _)] = loglikelihood([(long_context, [2, 7, 7])], bigram_forward(table), max_length=4, batch_size=1)
    assert loglik == pytest.approx(by_hand(table, long_context, [2, 7, 7])[0], abs=1e-5)


def test_padding_values_are_never_read():
    # A model that puts garbage where it sees the padding id must not change anything that is not padding.
    table = bigram_table()
    clean = bigram_forward(table)

    def poisoned(input_ids, targets):
        logprobs, greedy = clean(input_ids, targets)
        return torch.where(input_ids == 0, torch.tensor(math.nan), logprobs), greedy

    requests = [([1, 2], [3, 4, 5, 6, 7]), ([4], [5])]
    assert loglikelihood(requests, poisoned, max_length=8, batch_size=2) == \
        loglikelihood(requests, clean, max_length=8, batch_size=1)


@pytest.mark.parametrize("request_, message", [
    (([1, 2], [3, 4, 5]), "does not fit max_length=2"),
    (([], [3]), "empty context"),
])
def test_bad_requests_raise_value_error(request_, message):
    with pytest.raises(ValueError, match=message):
        loglikelihood([request_], bigram_forward(bigram_table()), max_length=2, batch_size=1)


def test_an_empty_continuation_scores_log_one_as_the_hf_backend_has_it():
    # lm-eval makes one when a continuation merges into the context's last token, or an empty context's continuation
    # is the prefix token alone.
    assert loglikelihood([([1], []), ([1, 2], [3])], bigram_forward(bigram_table()), max_length=4,
                         batch_size=1)[0] == (0.0, True)


def test_a_long_task_reports_its_progress(capsys):
    """Evaluation is never silent for long: rank 0 prints the task's start and, every so often, requests done."""
    from runtime.evaluate.__main__ import Progress

    report = Progress("demo_code_lines (3/3)", enabled=True, every_s=0.0)
    requests = [([1, 2 + i], [3]) for i in range(5)]
    loglikelihood(requests, lambda inputs, targets: (torch.zeros(targets.shape), torch.ones(targets.shape)),
                  max_length=8, batch_size=2, progress=report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "demo_code_lines (3/3): started"
    assert lines[1].startswith("demo_code_lines (3/3): 2/5 requests, ") and lines[1].endswith(" left")
    assert len(lines) == 3  # 2/5, 4/5; the last batch ends the task, whose own line follows
    quiet = Progress("x", enabled=False, every_s=0.0)
    quiet(1, 5)
    assert capsys.readouterr().out == ""
