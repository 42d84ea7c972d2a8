# A reward model (RLHF's first stage): one of our decoder families with a scalar score head in place of the LM
# head, trained on preference pairs with the Bradley-Terry loss of TRL's RewardTrainer, as an objective of
# runtime/step.py, so it runs under every layout the step runs.
#
# The model. The score head is Linear(hidden, 1, bias=False) at the model's `output` (so the step, the pipeline's
# last stage and the checkpoints find it where the LM head was; its weight is `output.weight`, (1, hidden), which
# runtime/convert/reward.py exports as transformers' `score.weight`). The model's `loss_fn` hands on the per-position
# scores (B, T) in fp32 instead of per-token losses, so what the step passes the objective is one score a position.
# Under tensor parallelism the final norm's output is the whole hidden state on every rank (the last row-parallel
# layer has summed it), so the head stays whole on every rank and each computes the full gradient; under sequence
# parallelism it first gathers the sequence (backward: each rank keeps its own part of the full gradient). Under
# pipeline parallelism the head is on the last stage only, like the LM head. The head starts normal(0,
# init_method_std), drawn from the model's seed like every parameter (runtime/models/init.py), so every layout
# starts from the same values (transformers' _init_weights draws a Linear the same way).
#
# The rows. The objective takes the alignment loader's micro-batches unchanged (runtime/alignment/data.py: m pairs
# = 2m rows, chosen rows first, input_ids t[:-1], labels t[1:], the loss mask on the response's labels) and rebuilds
# each row as the sequence itself, t[0], labels[:-1] = t[0..T-1], since the response's last token is in the labels
# but not in input_ids. The score is the final hidden state at the response's last token (its last loss-masked
# label: the end-of-turn marker, with the chat templates we support); a row whose response reaches its last label
# (a row filled to the end) is scored at its last position, the last token kept, as a sequence truncated to T
# tokens is. The rebuilt loss mask is 1 at the scored position only. Transformers' *ForSequenceClassification score
# the last token that is not padding: the same token, for a row padded after it (runtime/convert/reward.py).
#
# The loss (TRL 1.16 RewardTrainer.compute_loss), with r_c, r_r the chosen and rejected scores of a pair:
#     -log sigmoid(r_c - r_r - margin), mean over pairs  [+ center_rewards_coefficient * mean((r_c + r_r)^2)]
# margin: the pair's own (from the data; none by default). Exactness as the preference losses': every micro-batch
# backpropagates the sum of its pairs' terms / the global batch's pairs (counted over DP before any backward), so any
# split into micro-batches, DP ranks and pipeline stages gives the same gradients.
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.micro_batch import PreparedBatch
from runtime.models import meta_model
from runtime.models.init import Init, materialize
from runtime.models.transformer import CausalLM
from runtime.parallel import collectives as C
from runtime.schema.model import ModelConfig

# The statistics summed over a step's pairs (indices into the vector each micro-batch returns).
STATS = ("loss", "chosen_reward", "rejected_reward", "correct", "pairs")


class ScoreHead(nn.Module):
    """Linear(hidden, 1, bias=False): (B, T[/tp], H) final hidden states -> (B, T, 1) scores."""

    def __init__(self, hidden: int, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden))
        self.std = std
        self.sequence_axis = None  # the TP group when the hidden states arrive sequence-sharded

    def init_rules(self, prefix: str) -> dict[str, Init]:
        return {f"{prefix}.weight": Init("normal", self.std)}

    def parallelize(self, axis, sequence_parallel: bool) -> None:
        """Tensor parallelism's hook (runtime/parallel/parallelize.py): the head stays whole on every rank."""
        self.sequence_axis = axis if sequence_parallel else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_axis is not None:
            hidden = C.gather_sequence_replicated(hidden, self.sequence_axis)
        return F.linear(hidden, self.weight)


class PositionScores(nn.Module):
    """The model's loss_fn for a score head: (B, T, 1) scores, labels -> (B, T) scores in fp32 (labels unused)."""

    def forward(self, scores: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return scores.squeeze(-1).float()


def reward_config(cfg: ModelConfig) -> ModelConfig:
    """The reward model's config: the decoder's, with no output head tied to the embedding (the score head is
    its own weight)."""
    return dataclasses.replace(cfg, share_embeddings_and_output_weights=False)


def meta_reward_model(cfg: ModelConfig) -> CausalLM:
    """cfg's decoder family with the score head, every parameter on the meta device (parallelize_model
    materializes each rank's part)."""
    model = meta_model(reward_config(cfg))
    with torch.device("meta"):
        model.output = ScoreHead(cfg.hidden_size, cfg.init_method_std)
    model.loss_fn = PositionScores()
    model.gather_vocab = nn.Identity()
    return model


def build_reward_model(cfg: ModelConfig) -> CausalLM:
    """The whole reward model in fp32 on CPU, with the values cfg and cfg.seed define (as build_model)."""
    model = meta_reward_model(cfg)
    materialize(model, model.init_rules(), cfg.seed)
    return model


def scored_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(rows, T) loss mask over labels -> (rows,) positions of the rows' whole sequences to score: one past the
    last masked label (the response's last token, t[p + 1]), at most T - 1. A row without a masked label gets
    T - 1 (the data drops such pairs)."""
    T = loss_mask.shape[1]
    last = T - 1 - torch.flip(loss_mask > 0, dims=[1]).to(torch.int64).argmax(dim=1)
    return (last + 1).clamp(max=T - 1)


def whole_sequence_rows(batch: PreparedBatch) -> PreparedBatch:
    """The alignment rows (input_ids t[:-1], labels t[1:]) as the reward model reads them: input_ids t[0..T-1]
    (t[0], then the labels but the last), the loss mask 1 at each row's scored position only. Positions after it
    keep the label padding: causal attention keeps them from the score."""
    tokens = torch.cat([batch.input_ids[:, :1], batch.labels[:, :-1]], dim=1)
    at = scored_positions(batch.loss_mask)
    mask = torch.zeros_like(batch.loss_mask).scatter_(1, at[:, None], 1.0)
    return batch._replace(input_ids=tokens, loss_mask=mask)


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                         center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair terms whose mean over pairs is TRL's reward loss: -log sigmoid(r_c - r_r [- margin])
    [+ coefficient * (r_c + r_r)^2]."""
    difference = chosen - rejected if margin is None else chosen - rejected - margin
    terms = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        terms = terms + center_rewards_coefficient * (chosen + rejected) ** 2
    return terms


class RewardObjective:
    """The Bradley-Terry reward loss over micro-batches of m pairs = 2m rows with their pair_ids, as
    runtime/step.py's train_step, eval_result and the pipeline's last stage run an objective.

    margins: pair ids (m,) -> (m,) margins on the batch's device (TRL's optional per-pair "margin"), or None.
    center_rewards_coefficient: TRL's, None or 0 for none."""

    num_stats = len(STATS)

    def __init__(self, center_rewards_coefficient: float | None = None,
                 margins: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.center_rewards_coefficient = center_rewards_coefficient
        self.margins = margins

    def prepare(self, model: nn.Module, batches: list[PreparedBatch], topo) -> list[PreparedBatch]:
        """Each batch as whole sequences with the scored position masked (whole_sequence_rows)."""
        if topo.cp.size > 1:
            raise ValueError(f"training.model.context_parallel_size: {topo.cp.size} for a reward model, whose score "
                             "is one position of each row; set context_parallel_size=1")
        for batch in batches:
            if batch.pair_ids is None or batch.input_ids.shape[0] != 2 * batch.pair_ids.shape[0]:
                raise ValueError("a reward micro-batch has pair_ids, and 2 rows (chosen, rejected) per pair id")
            if batch.layout is not None:
                raise ValueError("a reward micro-batch holds one sequence a row (no position_ids)")
        return [whole_sequence_rows(batch) for batch in batches]

    def totals(self, batches: list[PreparedBatch]) -> torch.Tensor:
        """The pairs in this rank's micro-batches."""
        pairs = sum(batch.input_ids.shape[0] // 2 for batch in batches)
        return torch.tensor([float(pairs)], device=batches[0].input_ids.device)

    def rewards(self, scores: torch.Tensor, batch: PreparedBatch) -> torch.Tensor:
        """(2m, T) per-position scores of prepared rows -> (2m,) rewards, chosen rows first."""
        return (scores * batch.loss_mask).sum(-1)

    def __call__(self, scores: torch.Tensor, batch: PreparedBatch, totals: torch.Tensor | list[float]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        rewards = self.rewards(scores, batch)
        m = rewards.shape[0] // 2
        chosen, rejected = rewards[:m], rewards[m:]
        margin = None if self.margins is None else self.margins(batch.pair_ids).to(rewards)
        terms = bradley_terry_losses(chosen, rejected, margin, self.center_rewards_coefficient)
        chosen, rejected = chosen.detach(), rejected.detach()
        stats = torch.stack([terms.detach().sum(), chosen.sum(), rejected.sum(),
                             (chosen > rejected).sum().to(torch.float32),
                             torch.tensor(float(m), device=rewards.device)])
        return terms.sum() / totals[0], stats

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        s = dict(zip(STATS, stats))
        pairs = totals[0]
        return s["loss"] / pairs, {
            "reward_accuracy": s["correct"] / pairs,  # TRL's accuracy: the share with r_c > r_r
            "reward_margin": (s["chosen_reward"] - s["rejected_reward"]) / pairs,  # TRL's margin: mean r_c - r_r
            "chosen_reward": s["chosen_reward"] / pairs,
            "rejected_reward": s["rejected_reward"] / pairs,
        }
