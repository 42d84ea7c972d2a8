# GRPO's rollout: for this rank's prompts, G completions each (runtime/generate.py), their rewards and advantages,
# the rows the loss reads and the per-token log-probs of the policy before the update ("old") and of the frozen
# reference, all before the step that trains on them (runtime/rl/grpo.py).
#
#     batch = rollout(model, prompts, answers, config=cfg, reward=load_reward(path), decode=tokenizer.decode,
#                     stop_ids={eos}, topo=topo, seed=seed + step, prompt_indices=indices, reference=ref_model,
#                     micro_batch_size=2)
#     result = train_step(model, optimizer, micro_batches(batch, 2), topo, lr=lr, clip=1.0,
#                         objective=GRPOObjective(cfg, batch.table))
#
# A row is prompt + completion from position 0, padded on the right (causal attention never lets a real token see
# the pads after it, so a row scores as it would alone); the loss mask is on the completion's tokens up to and
# including the stop token, and off on a truncated completion (no stop token) with mask_truncated_completions.
#
# All of this rank's prompts are sampled in one generate() call, each prompt's G completions drawing from their own
# generator seeded by (seed, the prompt's index in the data), so they do not depend on how prompts are split over DP
# ranks or batched, and the same seed gives the same tokens.
# Any layout generation runs under (runtime/generate.py): tensor, pipeline and data parallelism, each stage of a
# pipeline generating the same completions.
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runtime.generate import generate
from runtime.micro_batch import MicroBatch, PreparedBatch
from runtime.parallel import collectives as C
from runtime.parallel.topology import Topology
from runtime.rl.grpo import GRPOConfig, RowTable, advantages
from runtime.rl.reward_model import ModelReward, rewards_of
from runtime.rl.rewards import Reward


class Rollout(NamedTuple):
    """This rank's rows for one step: N = prompts x G, each (N, T) and on the model's device; `table` is what the
    objective looks up by row id; `metrics` the rollout's own figures over the global batch (host floats)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    table: RowTable
    completions: list[list[int]]  # the sampled tokens, the stop token included when the completion has one
    texts: list[str]
    metrics: dict[str, float]


def rollout(model: nn.Module, prompts: Sequence[Sequence[int]], answers: Sequence[str], *, config: GRPOConfig,
            reward: Reward | ModelReward, decode: Callable[[list[int]], str], stop_ids: Iterable[int],
            topo: Topology, seed: int,
            prompt_indices: Sequence[int], micro_batch_size: int, reference: nn.Module | None = None,
            pad_id: int = 0, vocab_size: int | None = None, reward_name: str | None = None,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Rollout:
    """Sample, score and tokenize one step's rollouts of this DP rank's prompts (every DP rank the same number of
    prompts; every TP rank the same arguments). reference: the frozen model for the KL term (None when beta is 0).
    prompt_indices: each prompt's index in the data, which seeds its sampling and names it in a reward's error."""
    stops = set(stop_ids)
    G = config.num_generations
    completions = sample(model, prompts, config, stops=stops, seed=seed, prompt_indices=prompt_indices,
                         pad_id=pad_id, vocab_size=vocab_size, topo=topo)
    input_ids, labels, loss_mask, lengths, truncated = build_rows(prompts, completions, G, stops, pad_id,
                                                                  config.mask_truncated_completions)
    texts = [decode(c[:-1] if c and c[-1] in stops else c) for c in completions]
    rows_answers = [answers[row // G] for row in range(len(completions))]
    rows_indices = [prompt_indices[row // G] for row in range(len(completions))]
    device = next(model.parameters()).device
    rewards = torch.tensor(rewards_of(reward, texts, rows_answers, rows_indices, reward_name), device=device)
    everyone = _gather(torch.stack([rewards, truncated.to(device).float()]), topo)  # (2, N x dp), DP rank order
    advantage = advantages(everyone[0], G, config.scale_rewards)
    mine = slice(topo.dp.rank * len(completions), (topo.dp.rank + 1) * len(completions))
    input_ids, labels, loss_mask = input_ids.to(device), labels.to(device), loss_mask.to(device)
    old = token_log_probs(model, input_ids, labels, loss_mask, topo, micro_batch_size, autocast)
    ref = None
    if config.beta != 0:
        if reference is None:
            raise ValueError(f"grpo.beta: {config.beta} needs a reference model; none was given")
        ref = token_log_probs(reference, input_ids, labels, loss_mask, topo, micro_batch_size, autocast)
    table = RowTable(advantage[mine].contiguous(), old, ref, rewards, lengths.to(device))
    return Rollout(input_ids, labels, loss_mask, table, completions, texts, _metrics(everyone, G))


def sample(model: nn.Module, prompts: Sequence[Sequence[int]], config: GRPOConfig, *, stops: set[int], seed: int,
           prompt_indices: Sequence[int], pad_id: int = 0, vocab_size: int | None = None,
           topo: Topology | None = None) -> list[list[int]]:
    """G = num_generations completions per prompt, prompt after prompt (rows r*G .. r*G+G-1 are prompt r's), each
    ending with its stop token when it has one; temperature 0 is greedy. One generate() call over all the rows,
    each prompt's G rows drawing from their own generator seeded by prompt_seed(seed, its index). topo: the
    model's layout (needed for a pipeline stage without data parallelism; see generate())."""
    if len(prompts) != len(prompt_indices):
        raise ValueError(f"sample: {len(prompts)} prompts but {len(prompt_indices)} prompt indices")
    G = config.num_generations
    finished = (lambda row, tokens: tokens[-1] in stops) if stops else None  # keeps the stop token, unlike stop_ids
    return generate(model, [prompt for prompt in prompts for _ in range(G)],
                    max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
                    group_seeds=[prompt_seed(seed, index) for index in prompt_indices], pad_id=pad_id,
                    vocab_size=vocab_size, finished=finished, topo=topo)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of the prompt at `index` in the data, in a step seeded `seed`."""
    return (seed * 1_000_003 + index) % 2 ** 63


def build_rows(prompts: Sequence[Sequence[int]], completions: Sequence[list[int]], num_generations: int,
               stops: set[int], pad_id: int, mask_truncated: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, T) input_ids, labels and loss mask of rows prompt + completion, right-padded to the longest (T = its
    length - 1); (N,) completion lengths (stop token included) and whether each was truncated (no stop token)."""
    sequences = [list(prompts[row // num_generations]) + list(c) for row, c in enumerate(completions)]
    N, T = len(sequences), max(len(s) for s in sequences) - 1
    input_ids = torch.full((N, T), pad_id, dtype=torch.long)
    labels = torch.full((N, T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(N, T)
    truncated = torch.tensor([not (c and c[-1] in stops) for c in completions])
    for row, sequence in enumerate(sequences):
        n = len(sequence) - 1
        input_ids[row, :n] = torch.tensor(sequence[:-1])
        labels[row, :n] = torch.tensor(sequence[1:])
        # Label t is token t + 1: the completion's tokens are labels len(prompt) - 1 .. n - 1.
        if not (mask_truncated and truncated[row]):
            loss_mask[row, len(prompts[row // num_generations]) - 1:n] = 1.0
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
    return input_ids, labels, loss_mask, lengths, truncated


@torch.no_grad()
def token_log_probs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                    topo: Topology, micro_batch_size: int,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                    ) -> torch.Tensor:
    """(N, T) log-probs of each label under `model` (0 where the mask is), forward only in eval mode, in
    micro-batches; the same on every rank of the rows' TP and PP groups."""
    was_training = model.training
    model.eval()
    try:
        batches = [PreparedBatch(input_ids[i:i + micro_batch_size], labels[i:i + micro_batch_size],
                                 loss_mask[i:i + micro_batch_size])
                   for i in range(0, input_ids.shape[0], micro_batch_size)]
        if topo.pp.size > 1:
            from runtime.parallel.pipeline import collect_pipeline

            def per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                flat = logits.float().flatten(0, -2)
                return F.cross_entropy(flat, labels.flatten(), reduction="none").view(labels.shape)

            with autocast():
                losses = collect_pipeline(model, batches, topo, per_token, lambda ids: tuple(ids.shape))
        else:
            losses = []
            for batch in batches:
                with autocast():
                    losses.append(model(batch.input_ids, batch.labels, batch.layout).float())
        return -torch.cat(losses) * loss_mask
    finally:
        model.train(was_training)


def micro_batches(batch: Rollout, micro_batch_size: int) -> list[MicroBatch]:
    """The rollout's rows as the step's micro-batches, each row's id (its index in batch.table) as its pair_ids."""
    rows = batch.input_ids.shape[0]
    ids = torch.arange(rows, device=batch.input_ids.device)
    return [MicroBatch(batch.input_ids[i:i + micro_batch_size], batch.labels[i:i + micro_batch_size],
                       batch.loss_mask[i:i + micro_batch_size], None, ids[i:i + micro_batch_size])
            for i in range(0, rows, micro_batch_size)]


def _gather(local: torch.Tensor, topo: Topology) -> torch.Tensor:
    """(k, n) on every DP rank -> (k, n x dp), the ranks' columns in DP rank order."""
    if topo.dp.size == 1:
        return local
    out = torch.empty(topo.dp.size * local.numel(), dtype=local.dtype, device=local.device)
    C.all_gather_flat(out, local.reshape(-1), topo.dp)
    k, n = local.shape
    return out.view(topo.dp.size, k, n).permute(1, 0, 2).reshape(k, topo.dp.size * n)


def _metrics(everyone: torch.Tensor, num_generations: int) -> dict[str, float]:
    """The global batch's reward spread, the share of groups whose rewards are all equal (no learning signal) and
    the share of truncated completions."""
    rewards, truncated = everyone[0].float().cpu(), everyone[1].float().cpu()
    groups = rewards.view(-1, num_generations)
    zero_std = (groups.std(dim=1) if num_generations > 1 else torch.zeros(groups.shape[0])).abs() < 1e-8
    return {"reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "frac_reward_zero_std": zero_std.float().mean().item(),
            "truncated_ratio": truncated.mean().item()}
