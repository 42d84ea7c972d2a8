"""The preference losses against values computed by hand, from per-token log-probabilities on a small example:
only the response tokens (loss mask 1) count, chosen rows first in the micro-batch."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.alignment.objective import PreferenceObjective
from runtime.micro_batch import PreparedBatch

# Two pairs; sequences of 5 positions. Per-token losses are -log p. Masks select the response tokens.
PER_TOKEN = torch.tensor([
    [9.0, 9.0, 0.5, 1.0, 0.25],   # pair 0 chosen: response tokens 2..4
    [9.0, 0.2, 0.3, 0.0, 0.0],    # pair 1 chosen: response tokens 1..2 (then padding)
    [9.0, 9.0, 2.0, 1.5, 1.0],    # pair 0 rejected: response tokens 2..4
    [9.0, 0.1, 3.0, 0.0, 0.0],    # pair 1 rejected: response tokens 1..2
])
MASK = torch.tensor([
    [0, 0, 1, 1, 1],
    [0, 1, 1, 0, 0],
    [0, 0, 1, 1, 1],
    [0, 1, 1, 0, 0],
], dtype=torch.float32)
REFERENCE = torch.tensor([-2.0, -0.6, -4.0, -2.5])  # reference log-prob sums, rows in the same order
BETA = 0.1

# Response log-prob sums by hand: -(0.5 + 1 + 0.25), -(0.2 + 0.3), -(2 + 1.5 + 1), -(0.1 + 3).
CHOSEN, REJECTED = [-1.75, -0.5], [-4.5, -3.1]
REF_CHOSEN, REF_REJECTED = [-2.0, -0.6], [-4.0, -2.5]
LENGTHS = [3, 2]


def _batch():
    return PreparedBatch(None, None, MASK, reference=REFERENCE)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _run(objective):
    totals = objective.totals([PreparedBatch(torch.zeros(4, 5), None, MASK, pair_ids=torch.arange(2))]).tolist()
    loss, stats = objective(PER_TOKEN.clone().requires_grad_(), _batch(), totals)
    reported, metrics = objective.report(stats.tolist(), totals)
    return loss.item(), reported, metrics


def test_dpo_sigmoid_loss_and_rewards_by_hand():
    objective = PreferenceObjective("dpo", BETA, "sigmoid", references=lambda ids: None)
    margins = [(c - rc) - (r - rr) for c, rc, r, rr in zip(CHOSEN, REF_CHOSEN, REJECTED, REF_REJECTED)]
    expected = sum(-_log_sigmoid(BETA * m) for m in margins) / 2
    loss, reported, metrics = _run(objective)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert reported == pytest.approx(expected, rel=1e-6)
    chosen_rewards = [BETA * (c - rc) for c, rc in zip(CHOSEN, REF_CHOSEN)]      # 0.025, 0.01
    rejected_rewards = [BETA * (r - rr) for r, rr in zip(REJECTED, REF_REJECTED)]  # -0.05, -0.06
    assert metrics["chosen_reward"] == pytest.approx(sum(chosen_rewards) / 2, rel=1e-5)
    assert metrics["rejected_reward"] == pytest.approx(sum(rejected_rewards) / 2, rel=1e-5)
    assert metrics["reward_margin"] == pytest.approx((sum(chosen_rewards) - sum(rejected_rewards)) / 2, rel=1e-5)
    assert metrics["reward_accuracy"] == 1.0
    assert metrics["chosen_logps"] == pytest.approx(sum(CHOSEN) / 2, rel=1e-6)
    assert metrics["rejected_logps"] == pytest.approx(sum(REJECTED) / 2, rel=1e-6)


def test_ipo_loss_uses_mean_log_probs_by_hand():
    objective = PreferenceObjective("dpo", BETA, "ipo", references=lambda ids: None)
    expected = 0.0
    for c, rc, r, rr, n in zip(CHOSEN, REF_CHOSEN, REJECTED, REF_REJECTED, LENGTHS):
        expected += ((c - rc) / n - (r - rr) / n - 1 / (2 * BETA)) ** 2
    assert _run(objective)[0] == pytest.approx(expected / 2, rel=1e-6)


def test_orpo_loss_is_nll_plus_weighted_odds_ratio_by_hand():
    objective = PreferenceObjective("orpo", BETA)
    nll = (0.5 + 1.0 + 0.25 + 0.2 + 0.3) / 5  # the chosen responses' tokens, 3 + 2 of them
    ratio = 0.0
    for c, r, n in zip(CHOSEN, REJECTED, LENGTHS):
        pc, pr = c / n, r / n  # mean per-token log-probs
        log_odds = (pc - math.log1p(-math.exp(pc))) - (pr - math.log1p(-math.exp(pr)))
        ratio += -_log_sigmoid(log_odds)
    expected = nll + BETA * ratio / 2
    loss, reported, metrics = _run(objective)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert reported == pytest.approx(expected, rel=1e-6)
    assert metrics["chosen_nll"] == pytest.approx(nll, rel=1e-6)
    assert metrics["chosen_reward"] == pytest.approx(BETA * (CHOSEN[0] / 3 + CHOSEN[1] / 2) / 2, rel=1e-6)


def test_tokens_outside_the_response_do_not_count():
    """Changing a prompt token's (masked) loss changes nothing."""
    objective = PreferenceObjective("dpo", BETA, "sigmoid", references=lambda ids: None)
    before = _run(objective)[0]
    PER_TOKEN[:, 0] += 100.0
    try:
        assert _run(objective)[0] == before
    finally:
        PER_TOKEN[:, 0] -= 100.0


def test_the_gradient_is_the_hand_derivative():
    """d/d(per-token loss of a chosen response token) of the sigmoid loss = beta * sigmoid(-beta * margin) / pairs
    (the per-token loss is -log p, so it lowers the chosen log-prob)."""
    objective = PreferenceObjective("dpo", BETA, "sigmoid", references=lambda ids: None)
    per_token = PER_TOKEN.clone().requires_grad_()
    totals = objective.totals([PreparedBatch(torch.zeros(4, 5), None, MASK, pair_ids=torch.arange(2))]).tolist()
    objective(per_token, _batch(), totals)[0].backward()
    margin = (CHOSEN[0] - REF_CHOSEN[0]) - (REJECTED[0] - REF_REJECTED[0])
    expected = BETA / (1 + math.exp(BETA * margin)) / 2
    assert per_token.grad[0, 2].item() == pytest.approx(expected, rel=1e-5)
    assert per_token.grad[2, 2].item() == pytest.approx(-expected, rel=1e-5)
    assert per_token.grad[0, 0].item() == 0.0
