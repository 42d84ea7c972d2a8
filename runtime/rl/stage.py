# What the rl stage's trainer reads each step (runtime/train.py's loop: next_batch(), train_step with one objective,
# the step's metrics, state_dict() in the checkpoint): RolloutBatches samples this step's rollouts from the policy as
# it is now (runtime/rl/rollout.py) and hands back their micro-batches; its `objective` is one object whose GRPO
# table is the latest rollout's, and `metrics` the rollout's own figures, merged into the step's.
#
#     batches = RolloutBatches(PromptBatches(train_set, 16, seed=seed, dp_rank=..., dp_size=...), model,
#                              config=GRPOConfig(...), reward=load_reward(path), chat=chat, topo=topo, seed=seed,
#                              micro_batch_size=8)
#     for step in range(max_steps):
#         result = train_step(model, optimizer, batches.next_batch(), topo, lr=lr, clip=1.0,
#                             objective=batches.objective)
#         metrics = {**result.metrics, **batches.metrics}
#     held_out = greedy_reward(model, valid_set, reward=..., chat=chat, max_new_tokens=...)
#
# Seeds: step s samples with step_seed(seed, s), and each prompt with that and its index (rollout.prompt_seed), so
# a resumed run (consumed samples restored) draws what the uninterrupted one drew, at any DP size.
from __future__ import annotations

import contextlib
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from runtime.generate import generate
from runtime.micro_batch import MicroBatch, PreparedBatch
from runtime.parallel.topology import Topology
from runtime.rl.data import PromptBatches, PromptSet
from runtime.rl.grpo import GRPOConfig, GRPOObjective
from runtime.rl.reward_model import ModelReward, rewards_of
from runtime.rl.rewards import Reward
from runtime.rl.rollout import Rollout, micro_batches, rollout
from runtime.schema.chat import ChatTokenizer


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step` (0-based) of a run seeded `seed`."""
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1, np.uint64)[0] >> 2)


def decode_all(chat: ChatTokenizer, ids: list[int]) -> str:
    """A completion's text for its reward, special tokens included (the stop token is already cut): a policy must not
    earn an exact answer by padding it with tokens that decoding would otherwise drop (<|pad|>, <|im_start|>)."""
    return chat.decode(ids, skip_special_tokens=False)


class CurrentObjective:
    """The objective of the latest rollout (GRPO's, or PPO's policy objective), behind one object the trainer holds
    for the whole run: each next_batch() swaps in one over that rollout's table."""

    def __init__(self, num_stats: int = GRPOObjective.num_stats, name: str = "GRPO"):
        self.num_stats, self.name = num_stats, name
        self.current = None

    def _objective(self):
        if self.current is None:
            raise RuntimeError(f"the {self.name} objective has no rollout yet: call next_batch() before the step")
        return self.current

    def prepare(self, model, batches: list[PreparedBatch], topo) -> list[PreparedBatch]:
        return self._objective().prepare(model, batches, topo)

    def totals(self, batches: list[PreparedBatch]) -> torch.Tensor:
        return self._objective().totals(batches)

    def __call__(self, per_token: torch.Tensor, batch: PreparedBatch, totals):
        return self._objective()(per_token, batch, totals)

    def report(self, stats: list[float], totals: list[float]) -> tuple[float, dict[str, float]]:
        return self._objective().report(stats, totals)


class RolloutBatches:
    """Each step's GRPO micro-batches, sampled from `model` as it is when next_batch() is called."""

    def __init__(self, prompts: PromptBatches, model: nn.Module, *, config: GRPOConfig,
                 reward: Reward | ModelReward, chat: ChatTokenizer, topo: Topology, seed: int, micro_batch_size: int,
                 reference: nn.Module | None = None, reward_name: str | None = None,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        if config.beta != 0 and reference is None:
            raise ValueError(f"grpo.beta: {config.beta} needs a reference model; none was given (or set beta 0)")
        self.prompts, self.model, self.reference = prompts, model, reference
        self.config, self.reward, self.reward_name, self.chat = config, reward, reward_name, chat
        self.topo, self.seed, self.micro_batch_size, self.autocast = topo, int(seed), micro_batch_size, autocast
        self.objective = CurrentObjective()
        self.metrics: dict[str, float] = {}
        self.last: Rollout | None = None

    def next_batch(self) -> list[MicroBatch]:
        step = self.prompts.next_batch()
        started = time.perf_counter()
        out = rollout(self.model, step.prompts, step.answers, config=self.config, reward=self.reward,
                      decode=self.decode, stop_ids=self.chat.stop_ids, topo=self.topo,
                      seed=step_seed(self.seed, step.step), prompt_indices=step.indices,
                      micro_batch_size=self.micro_batch_size, reference=self.reference, pad_id=self.chat.pad_id,
                      vocab_size=self.chat.tokenizer.get_vocab_size(), reward_name=self.reward_name,
                      autocast=self.autocast)
        self.objective.current = GRPOObjective(self.config, out.table)
        self.metrics = {**out.metrics, "rollout_time_s": time.perf_counter() - started}
        self.last = out
        return micro_batches(out, self.micro_batch_size)

    def decode(self, ids: list[int]) -> str:
        return decode_all(self.chat, ids)

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


def greedy_reward(model: nn.Module, prompts: PromptSet, *, reward: Reward | ModelReward, chat: ChatTokenizer,
                  max_new_tokens: int,
                  limit: int | None = None, batch_size: int = 64, reward_name: str | None = None
                  ) -> dict[str, float]:
    """The held-out evaluation: greedy (temperature 0) completions of the first `limit` prompts, and their mean
    reward and share of exact answers (reward 1). Every rank computes the same figures (the same prompts, greedy
    decoding); under tensor parallelism every rank must call it."""
    count = len(prompts) if limit is None else min(limit, len(prompts))
    texts = []
    for start in range(0, count, batch_size):
        batch = prompts.prompts[start:min(start + batch_size, count)]
        completions = generate(model, batch, max_new_tokens=max_new_tokens, stop_ids=chat.stop_ids,
                               pad_id=chat.pad_id, vocab_size=chat.tokenizer.get_vocab_size())
        texts += [decode_all(chat, c) for c in completions]
    rewards = rewards_of(reward, texts, prompts.answers[:count], list(range(count)), reward_name)
    return {"eval_reward": sum(rewards) / max(count, 1),
            "eval_exact": sum(r == 1.0 for r in rewards) / max(count, 1)}
