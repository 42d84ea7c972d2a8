# GRPO (group relative policy optimization) as an objective of runtime/step.py, which runs it under every layout.
#
# A step's rows are G completions of each of its prompts (runtime/rl/rollout.py): prompt + completion, the loss mask
# on the completion tokens (up to and including the stop token). Each row has a scalar advantage, its reward
# relative to its group's (advantages()), and per token the log-probs of the policy that sampled it ("old") and of a
# frozen reference, both computed before the update. With logp the policy's log-prob now (-per_token):
#
#   ratio      r = exp(logp - old)                       (1 on the first update after sampling; its gradient is not)
#   clipped    -min(r * A, clamp(r, 1 - epsilon, 1 + epsilon_high) * A)    (r capped at delta first, if delta set)
#   KL         + beta * (exp(ref - logp) - (ref - logp) - 1)                (the k3 estimator; only when beta != 0)
#
# and the per-token terms are summed over completion tokens and normalized by loss_type (TRL's choices):
#
#   grpo     each row's mean over its tokens, then the mean over rows
#   bnpo     each micro-batch's mean over its tokens, then the mean over micro-batches
#   dr_grpo  the sum over tokens / (rows * max_completion_length)
#   dapo     the sum over tokens / tokens of the global batch (the default)
#
# Exactness: every normalizer above is a global count (rows, micro-batches, tokens) that totals() counts and the
# step sums over DP before any backward, so any split of the rows into micro-batches, DP ranks and pipeline stages
# gives the same gradients (bnpo's micro-batch means are those of the same micro-batches, however they are placed;
# TRL's bnpo, like this one, depends on the micro-batch size).
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from runtime.micro_batch import PreparedBatch
from runtime.schema.choices import GRPO_LOSS_TYPES, GRPO_SCALE_REWARDS

LOSS_TYPES = tuple(GRPO_LOSS_TYPES)          # the rl stage's config reads them (runtime/schema/training_rl.py)
SCALE_REWARDS = tuple(GRPO_SCALE_REWARDS)
# The statistics summed over a step's rows (indices into the vector each micro-batch returns).
STATS = ("objective", "kl", "clipped_low", "clipped_high", "reward", "completion_length")
# What TRL adds to the std before dividing by it, so a group whose rewards are all equal gets advantages of 0.
STD_EPSILON = 1e-4


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings, with TRL's (1.16) defaults. epsilon_high None: epsilon; delta None: no upper cap of the
    ratio's unclipped term. scale_rewards: 'group' (divide by the group's std), 'batch' (by the whole global
    batch's) or 'none'. temperature 0 samples greedily (every completion of a prompt then the same)."""

    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo.loss_type: {self.loss_type!r} is not one of {list(LOSS_TYPES)}")
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)  # TRL's bool spelling
        if scale not in SCALE_REWARDS:
            raise ValueError(f"grpo.scale_rewards: {self.scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
        object.__setattr__(self, "scale_rewards", scale)
        for key in ("num_generations", "max_completion_length"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"grpo.{key}: {value!r} must be a positive integer")
        if not self.beta >= 0:
            raise ValueError(f"grpo.beta: {self.beta!r} must be >= 0 (0: no KL term, no reference model)")
        if not 0 <= self.epsilon < 1 or not self.upper_epsilon >= 0:
            raise ValueError(f"grpo.epsilon: {self.epsilon!r} / epsilon_high: {self.epsilon_high!r} must be in "
                             "[0, 1) / >= 0")
        if self.delta is not None and not self.delta > 1 + self.upper_epsilon:
            raise ValueError(f"grpo.delta: {self.delta!r} must be above 1 + epsilon_high ({1 + self.upper_epsilon}),"
                             " or null")

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(N,) rewards of the global batch, G = num_generations consecutive rows per prompt -> (N,) advantages: the
    reward minus its group's mean, divided by (std + 1e-4) unless scale_rewards is 'none'. The std is unbiased
    (Bessel), of the group ('group') or of all N rewards ('batch'); one reward has none, so its std counts as 0."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of num_generations={num_generations}")
    groups = rewards.float().view(-1, num_generations)
    centered = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return centered
    if scale_rewards == "group":
        std = groups.std(dim=1, keepdim=True).expand_as(groups).reshape(-1) if num_generations > 1 \
            else torch.zeros_like(centered)
    elif scale_rewards == "batch":
        std = rewards.float().std().expand_as(centered) if rewards.numel() > 1 else torch.zeros_like(centered)
    else:
        raise ValueError(f"grpo.scale_rewards: {scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    return centered / (std + STD_EPSILON)


class RowTable(NamedTuple):
    """What the objective looks up by row id (a micro-batch's pair_ids), all on the rows' device.

    advantages (N,); old_logps and ref_logps (N, T) per token, aligned with the rows' labels (ref_logps None when
    beta is 0); rewards and completion_lengths (N,), for the metrics."""

    advantages: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor | None
    rewards: torch.Tensor
    completion_lengths: torch.Tensor


class GRPOObjective:
    """GRPO's loss over micro-batches of rows whose pair_ids are their row ids in `table` (this rank's rows)."""

    num_stats = len(STATS)

    def __init__(self, config: GRPOConfig, table: RowTable):
        if config.beta != 0 and table.ref_logps is None:
            raise ValueError(f"grpo.beta: {config.beta} needs the reference model's log-probs; none were computed")
        self.config, self.table = config, table

    def prepare(self, model, batches: list[PreparedBatch], topo) -> list[PreparedBatch]:
        for batch in batches:
            if batch.pair_ids is None or batch.pair_ids.shape[0] != batch.input_ids.shape[0]:
                raise ValueError("a GRPO micro-batch has pair_ids: one row id (into its rollout) per row")
        return batches

    def totals(self, batches: list[PreparedBatch]) -> torch.Tensor:
        """Rows, completion tokens and micro-batches of this rank (the step sums them over DP)."""
        tokens = torch.stack([batch.loss_mask.sum() for batch in batches]).sum()
        rows = sum(batch.input_ids.shape[0] for batch in batches)
        return torch.stack([torch.tensor(float(rows), device=tokens.device), tokens,
                            torch.tensor(float(len(batches)), device=tokens.device)])

    def __call__(self, per_token: torch.Tensor, batch: PreparedBatch, totals: torch.Tensor | list[float]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, table, ids, mask = self.config, self.table, batch.pair_ids, batch.loss_mask
        T = per_token.shape[1]
        counted = mask > 0
        logp = -per_token                                                     # (B, T)
        advantage = table.advantages[ids][:, None]                            # (B, 1)
        # Masked positions (prompt, padding) get a log-ratio of 0 before exp: their log-probs are meaningless and
        # exp of a large one would be inf, and inf * 0 NaN, in the value and in the gradient.
        ratio = torch.exp(torch.where(counted, logp - table.old_logps[ids, :T], 0.0))
        clipped = ratio.clamp(1 - cfg.epsilon, 1 + cfg.upper_epsilon)
        unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        terms = -torch.minimum(unclipped * advantage, clipped * advantage)
        kl = torch.zeros_like(terms)
        if cfg.beta != 0:
            gap = torch.where(counted, table.ref_logps[ids, :T] - logp, 0.0)
            kl = torch.exp(gap) - gap - 1
            terms = terms + cfg.beta * kl
        numerator = _numerator(cfg.loss_type, terms * mask, mask)
        loss = numerator / _denominator(cfg, totals)
        low = (ratio < 1 - cfg.epsilon) & (advantage < 0) & counted
        high = (ratio > 1 + cfg.upper_epsilon) & (advantage > 0) & counted
        stats = torch.stack([numerator.detach(), (kl * mask).detach().sum(), low.sum().float(), high.sum().float(),
                             table.rewards[ids].float().sum(), table.completion_lengths[ids].float().sum()])
        return loss, stats

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        s = dict(zip(STATS, stats))
        rows, tokens = totals[0], max(totals[1], 1.0)
        loss = s["objective"] / _denominator(self.config, totals)
        return loss, {
            "reward": s["reward"] / rows,
            "kl": s["kl"] / tokens,
            "completion_length": s["completion_length"] / rows,
            "clip_ratio": (s["clipped_low"] + s["clipped_high"]) / tokens,
            "clip_ratio_low": s["clipped_low"] / tokens,
            "clip_ratio_high": s["clipped_high"] / tokens,
        }


def _numerator(loss_type: str, masked: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the loss before the global normalizer."""
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()  # the rows' means, summed
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)  # this micro-batch's mean
    return masked.sum()  # dr_grpo, dapo


def _denominator(cfg: GRPOConfig, totals: torch.Tensor | list[float]) -> torch.Tensor | float:
    """The global normalizer of cfg.loss_type from the step's totals (rows, tokens, micro-batches); on the device
    when they are (the step reads nothing back before its end)."""
    rows, tokens, micro_batches = totals[0], totals[1], totals[2]
    if cfg.loss_type == "grpo":
        return rows
    if cfg.loss_type == "bnpo":
        return micro_batches
    if cfg.loss_type == "dr_grpo":
        return rows * cfg.max_completion_length
    return tokens.clamp(min=1.0) if isinstance(tokens, torch.Tensor) else max(tokens, 1.0)
