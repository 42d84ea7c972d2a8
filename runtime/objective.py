# What a training step minimizes, given each micro-batch's per-token losses: the objective. runtime/step.py runs it
# on one process, the pipeline's last stage (runtime/parallel/pipeline/executor.py) under pp; this module depends on
# neither, so both can import it.
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runtime.micro_batch import PreparedBatch


class TokenMean:
    """The objective of pretraining and fine-tuning: the mean loss over every counted token of the global batch.

    An objective (this, or runtime/alignment/objective.py's preference losses) is what the step and the pipeline's
    last stage do with a micro-batch's per-token losses: totals() are the global batch's denominators (counted
    before any backward, summed over DP; a device tensor, never read back inside the step), __call__ returns what to backpropagate (already divided by them) and the
    statistics to sum, and report() turns the summed statistics into the loss and metrics."""

    num_stats = 1  # the length of the statistics __call__ returns

    def prepare(self, model: Any, batches: list[PreparedBatch], topo: Any) -> list[PreparedBatch]:
        return batches

    def totals(self, batches: list[PreparedBatch]) -> torch.Tensor:
        return torch.stack([batch.loss_mask.sum() for batch in batches]).sum().reshape(1)

    def __call__(self, per_token: torch.Tensor, batch: PreparedBatch, totals: torch.Tensor | list[float]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        local = (per_token * batch.loss_mask).sum()
        return local / totals[0], local.detach().reshape(1)

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        return stats[0] / totals[0], {}


TOKEN_MEAN = TokenMean()
