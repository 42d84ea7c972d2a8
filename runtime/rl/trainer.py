# The rl stage inside the trainer (runtime/train.py): its train batches are RolloutBatches (each step's completions
# sampled from the policy, the trainer's own model, as it is then), its objective their current GRPO objective, and
# its validation the held-out prompts' greedy reward (HeldOut, logged as val_reward and val_exact, with no loss).
# The reference of the KL term (grpo.beta > 0) is a frozen copy of the policy as it starts: built before any
# checkpoint is loaded, so a resumed run keeps the same reference. With grpo.reward_model the reward is a reward model
# (runtime/rl/reward_model.py), built here beside the policy and bound to each prompt set's messages.
# RolloutBatches.state_dict (the prompts consumed) is the checkpoint's data position, and each step's sampling is
# seeded by its number: a resume draws what the uninterrupted run drew.
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from runtime.rl.data import PromptBatches, PromptSet, load_prompts, read_prompts
from runtime.rl.grpo import GRPOConfig
from runtime.rl.ppo import PPOConfig
from runtime.rl.ppo_trainer import Critic, PPOBatches, build_critic
from runtime.rl.reward_model import ModelReward, RewardModel, build_reward_model, reward_model_source
from runtime.rl.rewards import Reward, load_reward
from runtime.rl.stage import RolloutBatches, greedy_reward
from runtime.schema.chat import ChatTokenizer


class HeldOut:
    """The rl stage's validation: greedy completions of the first validation prompts and their mean reward. Every
    rank computes the same figures (the same prompts, greedy decoding)."""

    def __init__(self, prompts: PromptSet, *, reward: Reward | ModelReward, reward_name: str, chat: ChatTokenizer,
                 max_new_tokens: int):
        self.prompts, self.reward, self.reward_name = prompts, reward, reward_name
        self.chat, self.max_new_tokens = chat, max_new_tokens

    def evaluate(self, model: nn.Module, optimizer) -> dict[str, float]:
        optimizer.eval()  # schedule-free: its averaged weights are the ones to evaluate; the next step switches back
        figures = greedy_reward(model, self.prompts, reward=self.reward, chat=self.chat,
                                max_new_tokens=self.max_new_tokens, reward_name=self.reward_name)
        return {"reward": figures["eval_reward"], "exact": figures["eval_exact"]}


def build_rl(cfg, model: nn.Module, optimizer, topo, device, build_model: Callable[[], nn.Module]
             ) -> tuple[RolloutBatches, HeldOut | None]:
    """The rl stage's train batches (whose .objective is the step's objective) and its validation (None without
    validation prompts or checks). build_model builds another model like the policy, for the frozen reference."""
    from runtime.step import autocast_for

    rl, sft, stage = cfg.rl, cfg.sft, "rl.model.data"
    chat = ChatTokenizer(cfg.tokenizer_path, sft.chat_template)
    autocast = lambda: autocast_for(optimizer, device.torch_device)  # noqa: E731
    scorer = None if rl.reward_model is None else reward_scorer(cfg, chat, topo, device, autocast)
    reward = load_reward(rl.reward) if scorer is None else scorer.reward(_messages(sft.train_files, None))
    reward_name = rl.reward if scorer is None else rl.reward_model
    needs_answer = getattr(reward, "needs_answer", True)  # a reward may say it reads no answer
    train = load_prompts(sft.train_files, chat, needs_answer=needs_answer, max_prompt_length=rl.max_prompt_length,
                         key=f"{stage}.train_ds.file_names")
    config = GRPOConfig(**rl.trl)
    prompt_batches = PromptBatches(train, rl.prompts_per_step, seed=cfg.seed, dp_rank=topo.data_rank,
                                   dp_size=topo.data_size)
    common = dict(reward=reward, reward_name=reward_name, chat=chat, topo=topo, seed=cfg.seed,
                  micro_batch_size=cfg.data.micro_batch_size, autocast=autocast)
    if rl.algorithm == "ppo":  # the policy's objective and the critic's step (runtime/rl/ppo_trainer.py)
        ppo = PPOConfig(**rl.ppo)
        reference = frozen_copy(model, build_model) if ppo.kl_coef != 0 else None
        batches = PPOBatches(prompt_batches, model, ppo_critic(cfg, topo, device), sampling=config, config=ppo,
                             reference=reference, **common)
    else:
        reference = frozen_copy(model, build_model) if config.beta != 0 else None
        batches = RolloutBatches(prompt_batches, model, config=config, reference=reference, **common)
    valid = None
    if sft.validation_files and cfg.trainer.val_check_interval > 0 and cfg.trainer.limit_val_batches > 0:
        limit = cfg.trainer.limit_val_batches * rl.prompts_per_step
        prompts = load_prompts(sft.validation_files, chat, needs_answer=needs_answer,
                               max_prompt_length=rl.max_prompt_length, limit=limit,
                               key=f"{stage}.validation_ds.file_names")
        held_out = reward if scorer is None else scorer.reward(_messages(sft.validation_files, limit))
        valid = HeldOut(prompts, reward=held_out, reward_name=reward_name, chat=chat,
                        max_new_tokens=rl.max_completion_length)
    if device.is_main:
        print(f"rl ({rl.algorithm}): {len(train)} training prompts, {rl.prompts_per_step} per step x "
              f"{config.num_generations} "
              f"completions, reward {'model ' if scorer else ''}{reward_name}"
              + (f", {len(valid.prompts)} held-out prompts" if valid else ""), flush=True)
    return batches, valid


def ppo_critic(cfg, topo, device) -> Critic:
    """PPO's critic (runtime/rl/ppo_trainer.py build_critic), its optimizer (the policy's settings) and the
    policy's learning rate schedule."""
    from runtime.optim_schedule import LRSchedule
    from runtime.parallel import ShardedAdamW

    model = build_critic(cfg, topo, device)
    sched = cfg.optim.sched
    schedule = LRSchedule(sched.name, cfg.optim.lr, sched.max_steps, sched.warmup_steps, sched.constant_steps,
                          sched.min_lr)
    return Critic(model, ShardedAdamW(model, cfg.optim), schedule, cfg.trainer.gradient_clip_val)


def reward_scorer(cfg, chat: ChatTokenizer, topo, device, autocast) -> RewardModel:
    """grpo.reward_model built beside the policy (its TP group), frozen (runtime/rl/reward_model.py)."""
    source = reward_model_source(cfg.rl.reward_model, cfg.tokenizer_path, cfg.tokenizer_vocab_size)
    model = build_reward_model(source, topo, device.torch_device)
    return RewardModel(model, source, chat, micro_batch_size=cfg.data.micro_batch_size, autocast=autocast)


def _messages(files, limit: int | None) -> list:
    """The prompt records' messages, in the order load_prompts keeps them (a reward model renders them itself)."""
    return [record.prompt for record in read_prompts(files, needs_answer=False)[:limit]]


@torch.no_grad()
def frozen_copy(model: nn.Module, build_model: Callable[[], nn.Module]) -> nn.Module:
    """Another model like `model` (the same layout) holding its weights now, frozen, in eval mode."""
    reference = build_model()
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    return reference.eval()
