"""runtime/rl/grpo.py against TRL's GRPO (1.16) written out again here in plain torch, the way TRL computes it:
advantages from the rewards of each group, the model's log-probs from log_softmax over its logits in completion
windows (prompt left out, completions right-padded), the clipped ratio, the k3 KL, and each loss type's
normalization per micro-batch with TRL's gradient-accumulation divisors. The loss and every parameter's gradient
must agree within 1e-6."""
from __future__ import annotations

import pytest
import torch

from runtime.micro_batch import MicroBatch
from runtime.models import build_model
from runtime.rl.grpo import GRPOConfig, GRPOObjective, advantages
from tests.rl import fixed as F
from tests.runtime_parallel import harness as H


def trl_advantages(rewards: torch.Tensor, G: int, scale: str) -> torch.Tensor:
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    if scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = grouped.std(dim=1).repeat_interleave(G)
    out = rewards - mean
    return out if scale == "none" else out / (std + 1e-4)


def completion_windows(values: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    """(B, T) values aligned with labels -> (B, C) over each row's completion tokens, right-padded with 0."""
    out = torch.zeros(values.shape[0], max(lengths), dtype=values.dtype)
    for row, (start, n) in enumerate(zip(starts, lengths)):
        out[row, :n] = values[row, start:start + n]
    return out


def trl_micro_batch_loss(cfg: GRPOConfig, logits, labels, starts, lengths, truncated, adv, old, ref,
                         accumulation: int, num_items: float) -> torch.Tensor:
    """TRL's _compute_loss on one micro-batch (one process, steps_per_generation = accumulation steps)."""
    logps_all = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    logps = completion_windows(logps_all, starts, lengths)
    mask = completion_windows(torch.ones_like(logps_all), starts, lengths)
    if cfg.mask_truncated_completions:
        mask = mask * (~truncated).unsqueeze(1).float()
    old, ref = completion_windows(old, starts, lengths), completion_windows(ref, starts, lengths)
    advantages = adv.unsqueeze(1)
    coef_1 = torch.exp(logps - old)
    eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + eps_high)
    if cfg.delta is not None:
        coef_1 = torch.clamp(coef_1, max=cfg.delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if cfg.beta != 0.0:
        per_token_loss = per_token_loss + cfg.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if cfg.loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if cfg.loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if cfg.loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * cfg.max_completion_length) / accumulation
    normalizer = max(num_items, 1.0) * accumulation / accumulation  # num_items / processes * accum / steps_per_gen
    return (per_token_loss * mask).sum() / normalizer


def trl_reference(cfg: GRPOConfig, model) -> tuple[float, dict]:
    input_ids, labels, _, lengths, truncated = F.rows(cfg.mask_truncated_completions)
    table = F.table(cfg.scale_rewards, cfg.mask_truncated_completions)
    adv = trl_advantages(F.REWARDS, F.G, cfg.scale_rewards)
    starts = [len(F.PROMPTS[row // F.G]) - 1 for row in range(len(F.COMPLETIONS))]
    lengths = [len(c) for c in F.COMPLETIONS]
    mask_all = torch.tensor([0.0 if (cfg.mask_truncated_completions and t) else 1.0 for t in truncated])
    num_items = float(sum(n * m for n, m in zip(lengths, mask_all.tolist())))
    accumulation = len(F.COMPLETIONS) // F.MICRO_BATCH
    model.zero_grad()
    total = 0.0
    for i in range(0, len(F.COMPLETIONS), F.MICRO_BATCH):
        rows = slice(i, i + F.MICRO_BATCH)
        logits = model(input_ids[rows])
        loss = trl_micro_batch_loss(cfg, logits, labels[rows], starts[rows], lengths[rows], truncated[rows],
                                    adv[rows], table.old_logps[rows], table.ref_logps[rows], accumulation, num_items)
        loss.backward()
        total += loss.item()
    return total, {name: p.grad.clone() for name, p in model.named_parameters()}


def ours(cfg: GRPOConfig, model) -> tuple[float, dict]:
    """What runtime/step.py does with the objective on one process (pp 1): totals, then each micro-batch's loss
    backpropagated."""
    input_ids, labels, mask, _, _ = F.rows(cfg.mask_truncated_completions)
    objective = GRPOObjective(cfg, F.table(cfg.scale_rewards, cfg.mask_truncated_completions))
    ids = torch.arange(input_ids.shape[0])
    batches = [MicroBatch(input_ids[i:i + F.MICRO_BATCH], labels[i:i + F.MICRO_BATCH], mask[i:i + F.MICRO_BATCH],
                          None, ids[i:i + F.MICRO_BATCH]).prepare() for i in range(0, len(ids), F.MICRO_BATCH)]
    batches = objective.prepare(model, batches, None)
    totals = objective.totals(batches)
    model.zero_grad()
    total = 0.0
    for batch in batches:
        loss, _ = objective(model(batch.input_ids, batch.labels), batch, totals)
        loss.backward()
        total += loss.item()
    return total, {name: p.grad.clone() for name, p in model.named_parameters()}


CASES = {
    "grpo": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, loss_type="grpo"),
    "bnpo-kl": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, loss_type="bnpo", beta=0.04),
    "dr_grpo-kl-eps_high-unscaled": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION,
                                               loss_type="dr_grpo", beta=0.04, epsilon_high=0.28,
                                               scale_rewards="none"),
    "dapo-default": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION),
    "dapo-kl-delta-batch-masked": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION,
                                             beta=0.1, delta=1.3, scale_rewards="batch",
                                             mask_truncated_completions=True),
    "grpo-kl-masked": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, loss_type="grpo",
                                 beta=0.1, mask_truncated_completions=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_trls_formula(case):
    cfg = CASES[case]
    model = build_model(H.tiny_config("llama", init_method_std=0.1))
    expected_loss, expected_grads = trl_reference(cfg, model)
    loss, grads = ours(cfg, model)
    assert loss == pytest.approx(expected_loss, rel=1e-6, abs=1e-7)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().max() > 1e-4 for g in expected_grads.values()), "the case trains something"


def test_defaults_are_trls():
    cfg = GRPOConfig()
    assert (cfg.num_generations, cfg.beta, cfg.epsilon, cfg.upper_epsilon, cfg.loss_type, cfg.scale_rewards,
            cfg.mask_truncated_completions, cfg.max_completion_length, cfg.temperature, cfg.delta) == \
        (8, 0.0, 0.2, 0.2, "dapo", "group", False, 512, 1.0, None)
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    # Groups of 2: (1, 0) -> +-0.5 / (std 0.7071 + 1e-4); (0, 1) likewise; (2, 2) -> 0 (std 0).
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]) / torch.tensor([0.5 ** 0.5 + 1e-4] * 4 + [1e-4] * 2)
    torch.testing.assert_close(advantages(rewards, 2), expected)
    torch.testing.assert_close(advantages(rewards, 2, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(advantages(rewards, 2, "batch"),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]) / (rewards.std() + 1e-4))
    torch.testing.assert_close(advantages(rewards, 3), trl_advantages(rewards, 3, "group"))


def test_ratio_is_one_after_sampling_but_its_gradient_is_not():
    """old = the policy's own log-probs (one update per generation batch): the loss is -mean(A) over tokens (0
    for centered advantages with equal lengths) but the gradient is -A * d logp, not 0."""
    cfg = GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION)
    model = build_model(H.tiny_config("llama", init_method_std=0.1))
    input_ids, labels, mask, lengths, _ = F.rows()
    with torch.no_grad():
        old = -model(input_ids, labels) * mask
    table = F.table()._replace(old_logps=old)
    objective = GRPOObjective(cfg, table)
    batch = MicroBatch(input_ids, labels, mask, None, torch.arange(8)).prepare()
    loss, stats = objective(model(input_ids, labels), batch, objective.totals([batch]))
    expected = -(table.advantages * lengths).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    assert model.embed.word.weight.grad.abs().max() > 1e-4
    assert stats[2].item() == stats[3].item() == 0.0  # nothing clipped


def test_bad_settings_are_one_line_errors():
    for kwargs, key in [({"loss_type": "ppo"}, "grpo.loss_type"), ({"scale_rewards": "rows"}, "grpo.scale_rewards"),
                        ({"num_generations": 0}, "grpo.num_generations"), ({"beta": -1.0}, "grpo.beta"),
                        ({"delta": 1.1}, "grpo.delta")]:
        with pytest.raises(ValueError) as error:
            GRPOConfig(**kwargs)
        assert str(error.value).startswith(key) and "\n" not in str(error.value)
