"""runtime/rl/ppo.py against TRL PPOTrainer's formulas written out again here in plain torch the way TRL computes
them: on left-aligned completion windows (the prompt left out, right-padded), the KL estimators, the score at the
last token, whiten_rewards, the reversed GAE loop, masked_whiten of the advantages, the clipped policy loss and the
clipped value loss as masked means over the batch. Values, advantages, returns, both losses and their gradients
(with respect to the log-probs and the values) must agree within 1e-6, micro-batched as a step splits them."""
from __future__ import annotations

import pytest
import torch

from runtime.micro_batch import PreparedBatch
from runtime.rl.ppo import PPOConfig, PPOPolicyObjective, PPOTable, ValueObjective, gae, kl_terms, token_rewards, \
    whiten
from tests.rl import fixed as F


def windows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) aligned with labels -> (N, C) each row's completion tokens, left-aligned, right-padded with 0."""
    starts = (mask > 0).to(torch.int64).argmax(dim=1).tolist()
    lengths = mask.sum(1).to(torch.int64).tolist()
    out = torch.zeros(values.shape[0], max(lengths), dtype=values.dtype)
    for row, (start, n) in enumerate(zip(starts, lengths)):
        out[row, :n] = values[row, start:start + n]
    return out


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def masked_whiten(x, mask, shift_mean=True):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def trl_rollout(cfg: PPOConfig, scores, logps, ref_logps, values, lengths):
    """TRL's steps 4-6 on windows (B, C); `lengths` completion tokens per row (the score at the last of them)."""
    C = logps.shape[1]
    padding = torch.arange(C)[None, :] >= lengths[:, None]
    logr = ref_logps - logps
    kl = -logr if cfg.kl_estimator == "k1" else (logr.exp() - 1) - logr
    rewards = (-cfg.kl_coef * kl).masked_fill(padding, 0)
    rewards[torch.arange(len(lengths)), lengths - 1] += scores
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, (~padding).double(), shift_mean=False).masked_fill(padding, 0)
    values = values.masked_fill(padding, 0)
    last, reversed_ = 0, []
    for t in reversed(range(C)):
        nextvalues = values[:, t + 1] if t < C - 1 else 0.0
        delta = rewards[:, t] + cfg.gamma * nextvalues - values[:, t]
        last = delta + cfg.gamma * cfg.lam * last
        reversed_.append(last)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, (~padding).double()).masked_fill(padding, 0)
    return advantages, returns, padding


CONFIGS = {
    "defaults": PPOConfig(),
    "k3-whiten": PPOConfig(kl_estimator="k3", whiten_rewards=True, gamma=0.9, lam=0.8, kl_coef=0.2),
    "tight-clip": PPOConfig(cliprange=0.05, cliprange_value=0.01, vf_coef=0.5),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_ppo_equals_trl(name):
    cfg = CONFIGS[name]
    input_ids, labels, mask, lengths, _ = F.rows()
    mask = mask.double()
    N, T = mask.shape
    old, ref = F.logps((N, T), 1).double() * mask, F.logps((N, T), 2).double() * mask
    gen = torch.Generator().manual_seed(3)
    old_values = 0.5 * torch.randn((N, T), generator=gen, dtype=torch.float64)
    scores = F.REWARDS.double()

    kl = kl_terms(old, ref, mask, cfg.kl_estimator)
    rewards = token_rewards(scores, kl, mask, cfg.kl_coef)
    if cfg.whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False) * mask
    advantages, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, mask) * mask

    lens = mask.sum(1).to(torch.int64)
    want_adv, want_ret, padding = trl_rollout(cfg, scores, windows(old, mask), windows(ref, mask),
                                              windows(old_values, mask), lens)
    torch.testing.assert_close(windows(advantages, mask), want_adv, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(windows(returns, mask), want_ret.masked_fill(padding, 0), rtol=1e-6, atol=1e-9)

    # The update: log-probs and values moved off their rollout values, so both clips act.
    now = (old + 0.3 * torch.randn((N, T), generator=gen, dtype=torch.float64)) * mask
    values = old_values + 0.3 * torch.randn((N, T), generator=gen, dtype=torch.float64)
    table = PPOTable(advantages, returns, old, old_values, kl, scores, lengths.double())
    got = {}
    for key, objective, leaf in (("policy", PPOPolicyObjective(cfg, table), -now), ("value", ValueObjective(cfg, table),
                                                                                     values)):
        leaf = leaf.clone().requires_grad_(True)
        batches = [PreparedBatch(input_ids[i:i + F.MICRO_BATCH], labels[i:i + F.MICRO_BATCH],
                                 mask[i:i + F.MICRO_BATCH], None, torch.arange(i, min(i + F.MICRO_BATCH, N)))
                   for i in range(0, N, F.MICRO_BATCH)]
        totals = objective.totals(batches)
        loss = sum(objective(leaf[b.pair_ids], b, totals)[0] for b in batches)
        loss.backward()
        got[key] = (loss.detach(), leaf.grad)

    w = ~padding
    new_logps = windows(now, mask).requires_grad_(True)
    ratio = torch.exp(new_logps - windows(old, mask))
    pg = torch.max(-want_adv * ratio, -want_adv * torch.clamp(ratio, 1 - cfg.cliprange, 1 + cfg.cliprange))
    pg_loss = masked_mean(pg, w.double())
    pg_loss.backward()
    vpred = windows(values, mask).requires_grad_(True)
    mb_values = windows(old_values, mask)
    clipped = torch.clamp(vpred, mb_values - cfg.cliprange_value, mb_values + cfg.cliprange_value)
    vf = torch.max((vpred - want_ret) ** 2, (clipped - want_ret) ** 2)
    vf_loss = cfg.vf_coef * 0.5 * masked_mean(vf, w.double())
    vf_loss.backward()

    torch.testing.assert_close(got["policy"][0], pg_loss.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got["value"][0], vf_loss.detach(), rtol=1e-6, atol=1e-9)
    # d/d(per_token) = -d/d(logp)
    torch.testing.assert_close(-windows(got["policy"][1], mask), new_logps.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(windows(got["value"][1], mask), vpred.grad, rtol=1e-6, atol=1e-12)
    assert (got["policy"][1] * (1 - mask)).abs().max() == 0 and (got["value"][1] * (1 - mask)).abs().max() == 0


def test_num_ppo_epochs_above_one_is_refused():
    with pytest.raises(ValueError, match="ppo.num_ppo_epochs: 4 is not supported"):
        PPOConfig(num_ppo_epochs=4)
