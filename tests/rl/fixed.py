"""A fixed GRPO batch shared by the formula and layout tests: 2 prompts x G = 4 completions of unequal lengths
(one of them truncated), fixed rewards, and "old" and reference log-probs near a tiny random model's (about
log(1/128) per token) with enough spread that ratios leave the clip range on both sides."""
from __future__ import annotations

import torch

from runtime.rl.grpo import RowTable, advantages
from runtime.rl.rollout import build_rows

G = 4
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8]]
STOP = 3
# Completions: every one but row 5 ends with the stop token; row 5 is truncated at MAX_COMPLETION tokens.
COMPLETIONS = [[10, 11, 3], [12, 3], [13, 14, 15, 16, 3], [17, 18, 19, 20, 21, 22, 3],
               [30, 3], [31, 32, 33, 34, 35, 36, 37, 38], [39, 40, 41, 3], [3]]
MAX_COMPLETION = 8
REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
MICRO_BATCH = 2


def rows(mask_truncated: bool = False):
    """(input_ids, labels, loss_mask, lengths, truncated) of the 8 rows, (8, T)."""
    return build_rows(PROMPTS, COMPLETIONS, G, {STOP}, 0, mask_truncated)


def logps(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return -4.85 + 0.3 * torch.randn(shape, generator=gen)


def table(scale_rewards: str = "group", mask_truncated: bool = False, rows_slice: slice = slice(None)) -> RowTable:
    input_ids, _, mask, lengths, _ = rows(mask_truncated)
    shape = tuple(input_ids.shape)
    full = RowTable(advantages(REWARDS, G, scale_rewards), logps(shape, 1) * mask, logps(shape, 2) * mask, REWARDS,
                    lengths)
    return RowTable(*(t[rows_slice].contiguous() for t in full))
