# The preference losses (DPO, IPO, ORPO) as an objective of runtime/step.py, which runs them under every layout.
#
# A micro-batch of m pairs is 2m rows through the model in one batch: rows [:m] are the chosen responses, rows
# [m:] the rejected ones, each with the loss mask on its response tokens only. The model's per-token losses are
# -log p(token), so a row's log-probability of its response is -sum(per_token * mask).
#
#   DPO (sigmoid):  -log sigmoid(beta * ((c - c_ref) - (r - r_ref)))              c, r: summed response log-probs
#   IPO:            ((c - c_ref) - (r - r_ref) - 1 / (2 beta))^2                  c, r: mean per response token
#   ORPO:           NLL(chosen) + beta * -log sigmoid(log odds(c) - log odds(r))  c, r: mean per response token,
#                   odds(p) = p / (1 - p); NLL over the chosen tokens of the global batch, as SFT computes it
#
# Rewards (the metrics): DPO and IPO beta * (policy - reference), ORPO beta * c (TRL's convention); accuracy is
# the share of pairs whose chosen reward is strictly above the rejected one.
#
# Exactness: the loss is sum over pairs / global pairs (+ for ORPO the chosen tokens' NLL sum / global chosen
# tokens), and the step counts both totals over DP before any backward; every micro-batch backpropagates its own
# terms divided by them, so any split into micro-batches, DP ranks and pipeline stages gives the same gradients.
#
# Reference log-probabilities (DPO and IPO) come from `references`: a table indexed by pair id, computed once by
# the frozen starting model before training (runtime/alignment/reference.py), or, with LoRA and
# precompute_ref_log_probs false, this step's own batches scored by the base model with its adapters off.
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.micro_batch import PreparedBatch

# The statistics summed over a step's pairs (indices into the vector each micro-batch returns).
STATS = ("nll", "preference", "chosen_reward", "rejected_reward", "correct", "chosen_logps", "rejected_logps",
         "pairs")


def sequence_log_probs(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, T) per-token losses (-log p) and loss mask -> each row's summed response log-prob and token count."""
    return -(per_token * mask).sum(-1), mask.sum(-1)


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float, loss_type: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO (sigmoid) or IPO losses, and the chosen and rejected rewards (detached)."""
    logits = (chosen - ref_chosen) - (rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"DPO loss_type {loss_type!r} is not sigmoid or ipo")
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def orpo_losses(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair ORPO odds-ratio terms (already weighted by beta) from mean per-token log-probs, and the rewards."""
    log_odds = (chosen_mean - rejected_mean) - (_log1m_exp(chosen_mean) - _log1m_exp(rejected_mean))
    return -beta * F.logsigmoid(log_odds), beta * chosen_mean.detach(), beta * rejected_mean.detach()


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for a log-probability x < 0; log(-expm1(x)) keeps it finite close to 0, and the clamp keeps
    a response the model is certain of (x rounding to 0) finite rather than -inf."""
    return torch.log(-torch.expm1(x.clamp(max=-1e-6)))


class PreferenceObjective:
    """DPO / IPO / ORPO over micro-batches of m pairs = 2m rows, each with its pair_ids (runtime/micro_batch.py).

    references: for DPO and IPO, pair ids (m,) -> (m, 2) reference log-prob sums of (chosen, rejected) on the
    batch's device; or live(model, batch) scores the batch with the adapters off. ORPO needs neither."""

    num_stats = len(STATS)

    def __init__(self, strategy: str, beta: float, loss_type: str = "sigmoid",
                 references: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 live: Callable[[nn.Module, PreparedBatch], torch.Tensor] | None = None):
        if strategy not in ("dpo", "orpo"):
            raise ValueError(f"alignment strategy {strategy!r} is not dpo or orpo")
        if strategy == "dpo" and (references is None) == (live is None):
            raise ValueError("DPO needs its reference log-probabilities: a table, or live scoring with LoRA")
        self.strategy, self.beta, self.loss_type = strategy, float(beta), loss_type
        self.references, self.live = references, live

    def prepare(self, model: nn.Module, batches: list[PreparedBatch], topo) -> list[PreparedBatch]:
        """Each batch gains its (2m,) reference log-prob sums, chosen rows first (DPO), or None (ORPO)."""
        out = []
        for batch in batches:
            if batch.pair_ids is None or batch.input_ids.shape[0] != 2 * batch.pair_ids.shape[0]:
                raise ValueError("an alignment micro-batch has pair_ids, and 2 rows (chosen, rejected) per pair id")
            reference = None
            if self.strategy == "dpo":
                if self.live is not None:
                    reference = self.live(model, batch)
                else:
                    table = self.references(batch.pair_ids)  # (m, 2)
                    reference = torch.cat([table[:, 0], table[:, 1]]).to(torch.float32)
            out.append(batch._replace(reference=reference))
        return out

    def totals(self, batches: list[PreparedBatch]) -> torch.Tensor:
        """Pairs, and chosen response tokens (ORPO's NLL is a mean over those), in this rank's micro-batches."""
        pairs = sum(batch.input_ids.shape[0] // 2 for batch in batches)
        chosen = torch.stack([batch.loss_mask[:batch.input_ids.shape[0] // 2].sum() for batch in batches]).sum()
        return torch.stack([torch.tensor(float(pairs), device=chosen.device), chosen])

    def __call__(self, per_token: torch.Tensor, batch: PreparedBatch, totals: torch.Tensor | list[float]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        mask, reference = batch.loss_mask, batch.reference
        m = per_token.shape[0] // 2
        logps, counts = sequence_log_probs(per_token, mask)
        nll = (per_token[:m] * mask[:m]).sum()
        if self.strategy == "orpo":
            means = logps / counts.clamp(min=1)
            terms, chosen_reward, rejected_reward = orpo_losses(means[:m], means[m:], self.beta)
            loss = nll / _at_least_one(totals[1]) + terms.sum() / totals[0]
        else:
            if self.loss_type == "ipo":  # IPO compares mean per-token log-probs (policy and reference alike)
                policy, ref = logps / counts.clamp(min=1), reference / counts.clamp(min=1)
            else:
                policy, ref = logps, reference
            terms, chosen_reward, rejected_reward = dpo_losses(policy[:m], policy[m:], ref[:m], ref[m:], self.beta,
                                                               self.loss_type)
            loss = terms.sum() / totals[0]
        stats = torch.stack([nll.detach(), terms.detach().sum(), chosen_reward.sum(), rejected_reward.sum(),
                             (chosen_reward > rejected_reward).sum().to(torch.float32), logps[:m].detach().sum(),
                             logps[m:].detach().sum(), torch.tensor(float(m), device=per_token.device)])
        return loss, stats

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        s = dict(zip(STATS, stats))
        pairs = totals[0]
        nll = s["nll"] / max(totals[1], 1.0)
        loss = s["preference"] / pairs + (nll if self.strategy == "orpo" else 0.0)
        return loss, {
            "reward_accuracy": s["correct"] / pairs,
            "reward_margin": (s["chosen_reward"] - s["rejected_reward"]) / pairs,
            "chosen_reward": s["chosen_reward"] / pairs,
            "rejected_reward": s["rejected_reward"] / pairs,
            "chosen_logps": s["chosen_logps"] / pairs,
            "rejected_logps": s["rejected_logps"] / pairs,
            "chosen_nll": nll,
        }


def _at_least_one(total: torch.Tensor | float) -> torch.Tensor | float:
    """max(total, 1): a device tensor stays on the device (the step reads nothing back before its end)."""
    return total.clamp(min=1.0) if isinstance(total, torch.Tensor) else max(total, 1.0)
