# PPO with a critic (TRL PPOTrainer's formulas; NeMo-Launcher's rlhf_ppo: actor, critic, reward model, initial
# policy) as two objectives of runtime/step.py, which runs them under every layout: the policy's clipped ratio
# objective and the critic's clipped value objective. The rollout (runtime/rl/ppo_trainer.py) samples completions as
# GRPO's does (runtime/rl/rollout.py) and builds, per completion token, before either update:
#
#   kl_t       k1: logp_old - logp_ref;  k3: exp(ref - old) - 1 - (ref - old)        (0 when kl_coef is 0)
#   reward_t   -kl_coef * kl_t, plus the completion's score at its last token          (whitened if whiten_rewards)
#   value_t    the critic's value at the position that predicts token t (per_token of a score-head model)
#   GAE        delta_t = reward_t + gamma * value_{t+1} - value_t,  A_t = delta_t + gamma * lam * A_{t+1}
#   returns    A_t + value_t; then A whitened (mean 0, variance 1 over the completion tokens)
#
# and the losses, with logp and v the policy's log-prob and the critic's value now, r = exp(logp - logp_old):
#
#   policy     max(-A r, -A clamp(r, 1 - cliprange, 1 + cliprange))
#   value      vf_coef * 0.5 * max((v - ret)^2, (clamp(v, v_old - cliprange_value, v_old + cliprange_value) - ret)^2)
#
# each summed over completion tokens / the global batch's completion tokens (TRL: the mean over a mini-batch's
# tokens; here the whole step is one mini-batch, TRL's num_mini_batches 1). Whitening's mean and variance are over
# the global batch too (TRL whitens each process's batch: the same at one data-parallel rank). So every normalizer
# is a global count, summed over DP before any backward: any split into micro-batches, DP ranks and pipeline stages
# gives the same gradients (as runtime/rl/grpo.py).
#
# Where we differ from TRL: the score is added at the completion's last token (its stop token), and the value loss
# covers the completion's tokens; TRL 0.x adds it one position later (sequence_lengths + 1, a padding position when
# there is one) and extends the value loss's mask by that position.
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from runtime.micro_batch import PreparedBatch
from runtime.parallel import collectives as C

KL_ESTIMATORS = ("k1", "k3")
POLICY_STATS = ("objective", "clipped", "score", "completion_length", "kl")
VALUE_STATS = ("objective", "clipped", "value")
WHITEN_EPSILON = 1e-8  # TRL's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO's settings with TRL PPOConfig's key names and defaults (num_ppo_epochs: TRL's is 4; only 1 here)."""

    kl_coef: float = 0.05
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    kl_estimator: str = "k1"
    num_ppo_epochs: int = 1

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"ppo.kl_estimator: {self.kl_estimator!r} is not one of {list(KL_ESTIMATORS)}")
        if self.num_ppo_epochs != 1:
            raise ValueError(f"ppo.num_ppo_epochs: {self.num_ppo_epochs} is not supported; one update per rollout: "
                             f"set ppo.num_ppo_epochs=1")
        for key in ("kl_coef", "cliprange", "cliprange_value", "vf_coef", "gamma", "lam"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"ppo.{key}: {getattr(self, key)!r} must be >= 0")


def kl_terms(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """(N, T) per-token KL estimates of the sampling policy from the reference (0 off the mask)."""
    logr = torch.where(mask > 0, ref_logps - old_logps, 0.0)
    kl = -logr if estimator == "k1" else torch.expm1(logr) - logr
    return kl * mask


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """(N,) scores, (N, T) KL terms and mask -> (N, T) rewards: -kl_coef * kl per token, the score added at each
    row's last masked token (a row with no masked token gets none)."""
    rewards = -kl_coef * kl * mask
    T = mask.shape[1]
    last = T - 1 - torch.flip(mask > 0, dims=[1]).to(torch.int64).argmax(dim=1)
    has = (mask.sum(1) > 0).to(scores.dtype)
    return rewards.scatter_add(1, last[:, None], (scores * has)[:, None].to(rewards.dtype))


def whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, group=None) -> torch.Tensor:
    """TRL's masked_whiten over the masked entries of every rank of `group` (a DP axis, or None): (x - mean) /
    sqrt(var + 1e-8), var unbiased (Bessel), the mean added back unless shift_mean."""
    def total(x: torch.Tensor) -> torch.Tensor:
        if group is not None and group.size > 1:
            x = C.all_reduce(x.clone(), group)
        return x

    sums = total(torch.stack([(values * mask).sum(), mask.sum()]).double())
    count = sums[1]
    if count < 2:
        raise ValueError(f"whitening needs at least 2 completion tokens in the global batch, got {int(count)}")
    mean = sums[0] / count
    var = total(((values.double() - mean) ** 2 * mask).sum()) / (count - 1)
    whitened = (values.double() - mean) * torch.rsqrt(var + WHITEN_EPSILON)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.to(values.dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) per-token rewards and values over the rows' labels, the mask on the completion tokens -> (N, T)
    advantages and returns (advantages + values), 0 off the mask. Off the mask rewards and values count as 0, so the
    recursion starts at each completion's last token (TRL's values past the end are 0 too)."""
    rewards, values = rewards * mask, values * mask
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        following = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * following - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages * mask, (advantages + values) * mask


class PPOTable(NamedTuple):
    """What the objectives look up by row id (a micro-batch's pair_ids), on the rows' device: (N, T) whitened
    advantages, returns, the sampling policy's log-probs, the critic's values before its update, the KL terms; (N,)
    scores and completion lengths (for the metrics)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    old_logps: torch.Tensor
    old_values: torch.Tensor
    kl: torch.Tensor
    scores: torch.Tensor
    completion_lengths: torch.Tensor


def rollout_table(config: PPOConfig, scores: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor,
                  values: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, group=None) -> PPOTable:
    """A rollout's (N,) scores and completion lengths, (N, T) sampling and reference log-probs, the critic's values
    and the completion mask -> the objectives' table: per-token rewards, GAE, whitening over `group` (the DP axis:
    every rank's rows, so the global batch's mean and variance)."""
    kl = kl_terms(old_logps, ref_logps, mask, config.kl_estimator)
    rewards = token_rewards(scores, kl, mask, config.kl_coef)
    if config.whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False, group=group) * mask
    advantages, returns = gae(rewards, values, mask, config.gamma, config.lam)
    return PPOTable(whiten(advantages, mask, group=group) * mask, returns, old_logps, values, kl, scores, lengths)


def _check_rows(batches: list[PreparedBatch]) -> list[PreparedBatch]:
    for batch in batches:
        if batch.pair_ids is None or batch.pair_ids.shape[0] != batch.input_ids.shape[0]:
            raise ValueError("a PPO micro-batch has pair_ids: one row id (into its rollout) per row")
    return batches


def _totals(batches: list[PreparedBatch]) -> torch.Tensor:
    """Rows and completion tokens of this rank (the step sums them over DP)."""
    tokens = torch.stack([batch.loss_mask.sum() for batch in batches]).sum()
    rows = sum(batch.input_ids.shape[0] for batch in batches)
    return torch.stack([torch.tensor(float(rows), device=tokens.device), tokens])


def _tokens(totals) -> torch.Tensor | float:
    tokens = totals[1]
    return tokens.clamp(min=1.0) if isinstance(tokens, torch.Tensor) else max(tokens, 1.0)


class _OverTable:
    """An objective over micro-batches whose pair_ids are row ids into the rollout's `table`."""

    def __init__(self, config: PPOConfig, table: PPOTable):
        self.config, self.table = config, table

    def prepare(self, model, batches: list[PreparedBatch], topo) -> list[PreparedBatch]:
        return _check_rows(batches)

    def totals(self, batches: list[PreparedBatch]) -> torch.Tensor:
        return _totals(batches)


class PPOPolicyObjective(_OverTable):
    """The policy's clipped ratio objective over micro-batches whose pair_ids are row ids into `table`."""

    num_stats = len(POLICY_STATS)

    def __call__(self, per_token: torch.Tensor, batch: PreparedBatch, totals) -> tuple[torch.Tensor, torch.Tensor]:
        table, ids, mask = self.table, batch.pair_ids, batch.loss_mask
        T = per_token.shape[1]
        counted = mask > 0
        # Off the mask the log-ratio is 0 before exp: a meaningless log-prob there could make inf, and inf * 0 NaN.
        ratio = torch.exp(torch.where(counted, -per_token - table.old_logps[ids, :T], 0.0))
        advantage = table.advantages[ids, :T]
        clipped = ratio.clamp(1 - self.config.cliprange, 1 + self.config.cliprange)
        terms = torch.maximum(-advantage * ratio, -advantage * clipped)
        numerator = (terms * mask).sum()
        was_clipped = ((-advantage * clipped > -advantage * ratio) & counted).sum().float()
        stats = torch.stack([numerator.detach(), was_clipped, table.scores[ids].float().sum(),
                             table.completion_lengths[ids].float().sum(), (table.kl[ids, :T] * mask).sum()])
        return numerator / _tokens(totals), stats

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        s = dict(zip(POLICY_STATS, stats))
        rows, tokens = totals[0], max(totals[1], 1.0)
        return s["objective"] / tokens, {
            "reward": s["score"] / rows, "kl": s["kl"] / rows,  # TRL's objective/kl: summed over tokens, per row
            "completion_length": s["completion_length"] / rows, "clip_ratio": s["clipped"] / tokens}


class ValueObjective(_OverTable):
    """The critic's clipped value objective (times vf_coef) over the same micro-batches; per_token is the critic's
    per-position value (a score-head model's output, runtime/alignment/reward.py PositionScores)."""

    num_stats = len(VALUE_STATS)

    def __call__(self, values: torch.Tensor, batch: PreparedBatch, totals) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, table, ids, mask = self.config, self.table, batch.pair_ids, batch.loss_mask
        T = values.shape[1]
        old, returns = table.old_values[ids, :T], table.returns[ids, :T]
        clipped = torch.clamp(values, old - cfg.cliprange_value, old + cfg.cliprange_value)
        plain, far = (values - returns) ** 2, (clipped - returns) ** 2
        terms = 0.5 * torch.maximum(plain, far)
        numerator = (terms * mask).sum()
        stats = torch.stack([numerator.detach(), ((far > plain) & (mask > 0)).sum().float(),
                             (values.detach() * mask).sum()])
        return cfg.vf_coef * numerator / _tokens(totals), stats

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        s = dict(zip(VALUE_STATS, stats))
        tokens = max(totals[1], 1.0)
        return s["objective"] / tokens, {"vf_clipfrac": s["clipped"] / tokens, "value": s["value"] / tokens}
