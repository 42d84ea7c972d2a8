# What a training or evaluation step is handed, by name: a MicroBatch as the data loader (runtime/data/loader.py)
# cuts it, and the PreparedBatch the step makes of it for the model, the objective and the pipeline schedule.
# Fields have names because what a micro-batch carries depends on the stage (pretraining, packed fine-tuning rows,
# preference pairs), and a position that meant position ids in one place and a layout or reference log-probs in
# another is how a step silently trains on the wrong thing.
from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.models.layers import SequenceLayout

FIELDS = "(input_ids, labels, loss_mask[, position_ids[, pair_ids]])"


class MicroBatch(NamedTuple):
    """One micro-batch as the data produces it; every tensor (B, T), B = micro_batch_size (2m rows for m pairs).

    input_ids     int64  tokens[:, :-1] of a (B, T+1) sample
    labels        int64  tokens[:, 1:]
    loss_mask     float  1 where the token counts (fine-tuning: assistant tokens; padding 0); None: every token
    position_ids  int64  fine-tuning's packed rows, or pretraining's separated documents: positions restarting at
                         0 at every example, which also resets attention there; None: one causal sequence per row.
                         Under a context group, the whole row's (B, T·cp) while the tokens are the rank's (B, T)
    pair_ids      int64  the alignment stage's (m,) pair indices: rows [:m] chosen, [m:] rejected (the objective
                         looks up their reference log-probabilities by them); None otherwise
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    pair_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, value: MicroBatch | tuple) -> MicroBatch:
        """A MicroBatch, or a plain tuple in its field order (3 to 5 fields), as a MicroBatch."""
        if isinstance(value, cls):
            return value
        if len(value) not in (3, 4, 5):
            raise ValueError(f"a micro-batch is {FIELDS}; got a {len(value)}-tuple")
        return cls(*value)

    def to(self, device: torch.device) -> MicroBatch:
        """Every tensor on `device` (non-blocking copies); absent fields stay None."""
        return MicroBatch(*(None if t is None else t.to(device, non_blocking=True) for t in self))

    def prepare(self) -> PreparedBatch:
        """What the model and the objective read: the mask as float32 (ones where it is None), the positions as
        the SequenceLayout attention reads."""
        if self.input_ids.shape != self.labels.shape:
            raise ValueError(f"input_ids {tuple(self.input_ids.shape)} and labels {tuple(self.labels.shape)} differ "
                             "in shape")
        mask = torch.ones(self.labels.shape, device=self.labels.device) if self.loss_mask is None \
            else self.loss_mask.to(torch.float32)
        if self.position_ids is None:
            layout = None
        elif self.position_ids.shape[1] != self.input_ids.shape[1]:  # a context group's rank: the whole row's
            layout = SequenceLayout.context_split(self.position_ids)
        else:
            layout = SequenceLayout.packed(self.position_ids)
        return PreparedBatch(self.input_ids, self.labels, mask, layout, self.pair_ids)


class PreparedBatch(NamedTuple):
    """A micro-batch as the step (runtime/step.py), the objective and the pipeline's stages read it.

    loss_mask: float32 (B, T); None only in forward-only scoring that computes no loss (collect_pipeline).
    layout:    packed examples' SequenceLayout, or None.
    pair_ids:  as in MicroBatch.
    reference: what the objective's prepare() adds: DPO's (2m,) reference log-prob sums, chosen rows first.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None
    layout: SequenceLayout | None = None
    pair_ids: torch.Tensor | None = None
    reference: torch.Tensor | None = None
