# The rl stage's prompts: {"prompt": ..., "answer": ...} records read and checked (read_prompts), rendered with the
# chat template up to the generation prompt and tokenized once (load_prompts), and handed to the trainer a step's
# worth at a time (PromptBatches), each DP rank its share.
# The records' shape and reading: runtime/schema/prompts.py.
#
# Order: sample j of the run is prompt perm_e[j % n], e = j // n, with one permutation per epoch seeded by (seed, e)
# (the fine-tuning loader's epochs, runtime/sft/dataset.py: epoch_samples); a step takes the next prompts_per_step
# samples, rank r of dp the r-th contiguous share. The global order depends on the seed alone, so any DP size reads
# the same prompts per step, and consumed_samples is all a resume needs.
from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import numpy as np

from runtime.schema.chat import ChatTokenizer
# The records' reading is the schema's, which a launch checks the files with (runtime/schema/prompts.py).
from runtime.schema.prompts import FILES_KEY, SHAPE, PromptRecord, read_prompts, to_prompt_record  # noqa: F401


class PromptSet(NamedTuple):
    """Tokenized prompts (each ending with the chat template's generation prompt), their answers and where each
    came from, in file order."""

    prompts: list[list[int]]
    answers: list[str]
    wheres: list[str]

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompts(paths: Sequence[str | os.PathLike], chat: ChatTokenizer, *, needs_answer: bool = True,
                 max_prompt_length: int | None = None, limit: int | None = None,
                 key: str = FILES_KEY) -> PromptSet:
    """Read, render and tokenize the prompt records of `paths` (the first `limit` of them when given). A prompt of
    more than max_prompt_length tokens is an error naming it: it would leave no room to answer."""
    records = read_prompts(paths, needs_answer, key)[:limit]
    wheres = [r.where for r in records]
    prompts = chat.prompts_ids([r.prompt for r in records], wheres)
    if max_prompt_length is not None:
        for where, ids in zip(wheres, prompts):
            if len(ids) > max_prompt_length:
                raise ValueError(f"{where}: the prompt has {len(ids)} tokens with the chat template, more than "
                                 f"max_prompt_length {max_prompt_length}; shorten it or raise the limit")
    return PromptSet(prompts, [r.answer for r in records], wheres)


class StepPrompts(NamedTuple):
    """This rank's prompts of one step: token ids, answers, their indices in the PromptSet (which seed their
    sampling and name them in errors) and the step's number (0-based) in the run."""

    prompts: list[list[int]]
    answers: list[str]
    indices: list[int]
    step: int


class PromptBatches:
    """This DP rank's share of prompts_per_step prompts per step, read in seeded epochs (see the top of the file)."""

    def __init__(self, prompts: PromptSet, prompts_per_step: int, *, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0):
        if len(prompts) == 0:
            raise ValueError("the prompt set is empty: nothing to train on")
        if isinstance(prompts_per_step, bool) or not isinstance(prompts_per_step, int) or prompts_per_step < 1 \
                or prompts_per_step % dp_size:
            raise ValueError(f"prompts_per_step: {prompts_per_step!r} must be a positive multiple of the data-"
                             f"parallel size {dp_size}")
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.data, self.prompts_per_step, self.seed = prompts, prompts_per_step, int(seed)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self._epoch, self._permutation = -1, np.empty(0, dtype=np.int64)

    def index(self, sample: int) -> int:
        """The PromptSet index of the run's sample number `sample`."""
        epoch, position = divmod(sample, len(self.data))
        if epoch != self._epoch:  # reading goes epoch by epoch, so one permutation at a time is enough
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
            self._epoch = epoch
        return int(self._permutation[position])

    def batch_at(self, batch_start: int) -> StepPrompts:
        per_rank = self.prompts_per_step // self.dp_size
        first = batch_start + self.dp_rank * per_rank
        indices = [self.index(sample) for sample in range(first, first + per_rank)]
        return StepPrompts([self.data.prompts[i] for i in indices], [self.data.answers[i] for i in indices],
                           indices, batch_start // self.prompts_per_step)

    def next_batch(self) -> StepPrompts:
        batch = self.batch_at(self.consumed_samples)
        self.consumed_samples += self.prompts_per_step
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
