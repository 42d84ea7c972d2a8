# The rl stage's PPO (algorithm: ppo) inside the trainer (runtime/train.py), behind the hook GRPO uses: PPOBatches
# is the train batches whose next_batch() samples this step's completions from the policy (as GRPO's rollout does,
# runtime/rl/rollout.py), scores them, computes the policy's and the reference's per-token log-probs and the
# critic's values, the per-token rewards, GAE and whitening (runtime/rl/ppo.py), takes the critic's step (its value
# objective, its own ShardedAdamW), and hands back the policy's micro-batches, whose objective (.objective) the
# trainer's step then runs. The critic's update comes before the policy's but reads nothing the policy's changes:
# it is TRL's one backward of pg_loss + vf_coef * vf_loss, split in two (each with its own gradient clipping).
#
# The critic: the reward model's family (runtime/alignment/reward.py: the decoder with a ScoreHead, PositionScores
# giving a value per position), parallelized as the policy (tp, pp, dp, ZeRO-1), starting from grpo.reward_model
# when set (TRL and NeMo-Launcher start the critic from the reward model), else from the policy's starting weights
# (model.restore_from_path, or its seeded random init) with a fresh score head. Its checkpoints are a second
# TrainingCheckpoints under <results_dir>/critic_checkpoints, saved and resumed with the policy's (PairedCheckpoints).
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable

import torch
from torch import nn

from runtime.micro_batch import MicroBatch, PreparedBatch
from runtime.parallel.topology import Topology
from runtime.rl.data import PromptBatches
from runtime.rl.grpo import GRPOConfig
from runtime.rl.ppo import PPOConfig, PPOPolicyObjective, PPOTable, ValueObjective, rollout_table
from runtime.rl.reward_model import ModelReward, rewards_of
from runtime.rl.rewards import Reward
from runtime.rl.rollout import build_rows, sample, token_log_probs
from runtime.rl.stage import CurrentObjective, decode_all, step_seed
from runtime.schema.chat import ChatTokenizer


def build_critic(cfg, topo: Topology, device) -> nn.Module:
    """This rank's part of the critic, laid out as the policy (runtime/finetune.py parallelize_as_configured)."""
    from runtime.alignment.reward import meta_reward_model
    from runtime.finetune import parallelize_as_configured, starting_weights
    from runtime.rl import reward_model as rm

    if cfg.rl.reward_model is not None:
        source = rm.reward_model_source(cfg.rl.reward_model, cfg.tokenizer_path, cfg.tokenizer_vocab_size)
        meta, start = meta_reward_model(source.cfg), (lambda model, plan: rm._load(model, plan, source))
    else:
        meta, start = meta_reward_model(cfg.model), starting_weights(cfg.restore_from_path, score_head=True)
    return parallelize_as_configured(cfg, meta, topo, device, start)


@torch.no_grad()
def critic_values(critic: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                  topo: Topology, micro_batch_size: int,
                  autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """(N, T) the critic's value at each label's position (0 off the mask), forward only in eval mode; the same on
    every rank of the rows' TP and PP groups."""
    was_training = critic.training
    critic.eval()
    try:
        batches = [PreparedBatch(input_ids[i:i + micro_batch_size], labels[i:i + micro_batch_size],
                                 loss_mask[i:i + micro_batch_size])
                   for i in range(0, input_ids.shape[0], micro_batch_size)]
        with autocast():
            if topo.pp.size > 1:
                from runtime.parallel.pipeline import collect_pipeline

                values = collect_pipeline(critic, batches, topo, lambda scores, labels: scores.squeeze(-1).float(),
                                          lambda ids: tuple(ids.shape))
            else:
                values = [critic(b.input_ids, b.labels, b.layout).float() for b in batches]
        return torch.cat(values) * loss_mask
    finally:
        critic.train(was_training)


@dataclasses.dataclass
class Critic:
    model: nn.Module
    optimizer: object                    # its ShardedAdamW
    lr: Callable[[int], float]           # the step's learning rate (the policy's schedule)
    clip: float | None


class PPOBatches:
    """Each step's PPO micro-batches (and the critic's step), sampled from `model` as it is at next_batch()."""

    def __init__(self, prompts: PromptBatches, model: nn.Module, critic: Critic, *, sampling: GRPOConfig,
                 config: PPOConfig, reward: Reward | ModelReward, chat: ChatTokenizer, topo: Topology, seed: int,
                 micro_batch_size: int, reference: nn.Module | None = None, reward_name: str | None = None,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        if config.kl_coef != 0 and reference is None:
            raise ValueError(f"ppo.kl_coef: {config.kl_coef} needs a reference model; none was given")
        self.prompts, self.model, self.critic, self.reference = prompts, model, critic, reference
        self.sampling, self.config, self.chat = sampling, config, chat
        self.reward, self.reward_name = reward, reward_name
        self.topo, self.seed, self.micro_batch_size, self.autocast = topo, int(seed), micro_batch_size, autocast
        self.objective = CurrentObjective(PPOPolicyObjective.num_stats, "PPO")
        self.metrics: dict[str, float] = {}

    def next_batch(self) -> list[MicroBatch]:
        step = self.prompts.next_batch()
        started = time.perf_counter()
        G, cfg, stops = self.sampling.num_generations, self.config, set(self.chat.stop_ids)
        completions = sample(self.model, step.prompts, self.sampling, stops=stops, seed=step_seed(self.seed, step.step),
                             prompt_indices=step.indices, pad_id=self.chat.pad_id,
                             vocab_size=self.chat.tokenizer.get_vocab_size(), topo=self.topo)
        input_ids, labels, mask, lengths, truncated = build_rows(step.prompts, completions, G, stops, self.chat.pad_id,
                                                                 self.sampling.mask_truncated_completions)
        texts = [decode_all(self.chat, c[:-1] if c and c[-1] in stops else c) for c in completions]
        device = next(self.model.parameters()).device
        scores = torch.tensor(rewards_of(self.reward, texts, [step.answers[r // G] for r in range(len(texts))],
                                         [step.indices[r // G] for r in range(len(texts))], self.reward_name),
                              device=device, dtype=torch.float32)
        input_ids, labels, mask = input_ids.to(device), labels.to(device), mask.to(device)
        forward = dict(topo=self.topo, micro_batch_size=self.micro_batch_size, autocast=self.autocast)
        old = token_log_probs(self.model, input_ids, labels, mask, **forward)
        ref = old if cfg.kl_coef == 0 else token_log_probs(self.reference, input_ids, labels, mask, **forward)
        values = critic_values(self.critic.model, input_ids, labels, mask, **forward)
        dp = self.topo.dp
        table = rollout_table(cfg, scores, old, ref, values, mask, lengths.to(device), group=dp)
        ids = torch.arange(input_ids.shape[0], device=device)
        m = self.micro_batch_size
        batches = [MicroBatch(input_ids[i:i + m], labels[i:i + m], mask[i:i + m], None, ids[i:i + m])
                   for i in range(0, input_ids.shape[0], m)]
        self.metrics = {**self._critic_step(batches, table, step.step),
                        **_global_figures(scores, truncated.to(device).float(), dp),
                        "rollout_time_s": time.perf_counter() - started}
        self.objective.current = PPOPolicyObjective(cfg, table)
        return batches

    def _critic_step(self, batches: list[MicroBatch], table: PPOTable, step: int) -> dict[str, float]:
        from runtime.step import train_step

        critic = self.critic
        result = train_step(critic.model, critic.optimizer, batches, self.topo, lr=critic.lr(step), clip=critic.clip,
                            objective=ValueObjective(self.config, table))
        result.read()
        return {"vf_loss": result.loss, "vf_grad_norm": result.grad_norm, **result.metrics}

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)

    def with_critic(self, checkpoints):
        """The policy's TrainingCheckpoints paired with the critic's, under <results_dir>/critic_checkpoints."""
        from runtime.checkpoint.session import TrainingCheckpoints

        cfg = checkpoints.cfg
        critic_cfg = dataclasses.replace(cfg, dirpath=os.path.join(os.path.dirname(str(cfg.dirpath).rstrip("/")),
                                                                   "critic_checkpoints"), resume_from_checkpoint=None)
        critic = TrainingCheckpoints(critic_cfg, checkpoints.device, checkpoints.topo, self.critic.model,
                                     self.critic.optimizer, _NoData(), checkpoints.raw_config, checkpoints.max_steps)
        return PairedCheckpoints(checkpoints, critic)


def _global_figures(scores, truncated, dp) -> dict[str, float]:
    """The global batch's score spread and share of truncated completions."""
    from runtime.parallel import collectives as C

    local = torch.stack([scores.sum(), (scores ** 2).sum(), truncated.sum(),
                         torch.tensor(float(scores.numel()), device=scores.device)]).double()
    if dp.size > 1:
        local = C.all_reduce(local, dp)
    total, square, cut, n = local.tolist()
    mean = total / n
    return {"reward_std": max(square / n - mean * mean, 0.0) ** 0.5 * (n / max(n - 1, 1)) ** 0.5,
            "truncated_ratio": cut / n}


class _NoData:
    """The critic's checkpoint holds no data position (the policy's holds it)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PairedCheckpoints:
    """The policy's TrainingCheckpoints and the critic's, saved together and resumed to the same step; anything else
    (last_saved, resumed, cfg) is the policy's."""

    def __init__(self, policy, critic):
        self.policy, self.critic = policy, critic

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def check_room(self, results_dir: str) -> None:
        self.policy.check_room(results_dir)
        self.critic.check_room(results_dir)

    def resume(self) -> int:
        step = self.policy.resume()
        critic = self.critic.resume()
        if critic != step:
            raise ValueError(f"{self.critic.cfg.dirpath}: the critic's newest complete checkpoint is at step {critic}, "
                             f"the policy's at {step}; remove the newer one's step_* directory to resume from the "
                             f"older step")
        return step

    def after_step(self, done: int) -> None:
        self.policy.after_step(done)
        self.critic.after_step(done)

    def save_and_wait(self, step: int) -> None:
        self.policy.save_and_wait(step)
        self.critic.save_and_wait(step)

    def wait(self) -> None:
        self.policy.wait()
        self.critic.wait()

    def wait_quietly(self) -> None:
        self.policy.wait_quietly()
        self.critic.wait_quietly()
