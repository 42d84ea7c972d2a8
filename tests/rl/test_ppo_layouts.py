"""PPO's step under tensor, data and pipeline parallelism (2 real gloo ranks each) against one process, on one fixed
rollout (tests/rl/fixed.py's completions and scores, fixed sampling and reference log-probs and critic values) made
into the objectives' table by runtime/rl/ppo.py rollout_table (the trainer's code, whitening over the DP axis) and
trained twice as the trainer does, the critic's value step then the policy's PPO step: the whitened advantages and
the returns, every step's policy and value loss, metrics and grad norms within 1e-6 relative (or 1e-6 absolute: see
FLOOR), and both models' weights after the two steps within 1e-6 of each tensor's size. Each dp2 rank holds one prompt's completions (of other
lengths and scores than the other rank's), so only whitening with the global batch's mean and variance matches."""
from __future__ import annotations

import pytest
import torch

from runtime.alignment.reward import build_reward_model
from runtime.device import flash_attention_kernels
from runtime.micro_batch import MicroBatch
from runtime.models import build_model
from runtime.parallel import (DataParallelConfig, ParallelDims, ShardedAdamW, Topology, gather_full_state_dict,
                              parallelize_model)
from runtime.rl.ppo import PPOConfig, PPOPolicyObjective, ValueObjective, rollout_table
from runtime.step import train_step
from tests.rl import fixed as F
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

STEPS = 2
OPTIM = {**H.OPTIM, "eps": 1e-3}  # as tests/rl/test_grpo_layouts.py: the weights compare the sharding, not rounding
LAYOUTS = {"tp2": (2, 1, 1), "dp2": (1, 1, 2), "pp2": (1, 2, 1)}  # (tp, pp, dp)
CONFIGS = {
    "defaults": PPOConfig(),
    # Rewards whitened too (over DP as the advantages), k3, discounting, tight clips on both models.
    "k3-whiten": PPOConfig(kl_estimator="k3", whiten_rewards=True, gamma=0.9, lam=0.8, kl_coef=0.2, cliprange=0.1,
                           cliprange_value=0.05, vf_coef=0.5),
}
# The policy loss (whitened advantages: mean 0, times ratios near 1) and the mean value are means of O(1) terms of
# both signs that nearly cancel (the policy loss is about 3e-4): float32's noise in another summation order is
# absolute there (about 1e-7 of the terms' size), so they compare within 1e-6 relative or 1e-6 absolute.
FLOOR = 1e-6
MODEL = dict(num_layers=4, init_method_std=0.1)


def rollout(cfg: PPOConfig, rows: slice = slice(None), group=None):
    """(input_ids, labels, mask, table) of the fixed rollout's `rows`, whitened over `group`."""
    input_ids, labels, mask, lengths, _ = F.rows()
    shape = tuple(mask.shape)
    values = 0.5 * torch.randn(shape, generator=torch.Generator().manual_seed(3)) * mask
    fixed = (F.REWARDS, F.logps(shape, 1) * mask, F.logps(shape, 2) * mask, values, mask, lengths)
    input_ids, labels, scores, old, ref, values, mask, lengths = (
        t[rows].contiguous() for t in (input_ids, labels, *fixed))
    return input_ids, labels, mask, rollout_table(cfg, scores, old, ref, values, mask, lengths, group=group)


def _model(build, topo: Topology):
    model = parallelize_model(build(H.tiny_config("llama", **MODEL)), topo,
                              data_parallel=DataParallelConfig("fp32", False, bucket_numel=H.BUCKET_NUMEL),
                              attention_kernels=flash_attention_kernels)
    return model, ShardedAdamW(model, OPTIM)


def train(cfg: PPOConfig, tp: int, pp: int, dp: int) -> dict:
    topo = Topology.build(ParallelDims(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp))
    per_rank = len(F.COMPLETIONS) // topo.data_size
    rows = slice(topo.data_rank * per_rank, (topo.data_rank + 1) * per_rank)
    input_ids, labels, mask, table = rollout(cfg, rows, topo.dp)
    ids, m = torch.arange(per_rank), F.MICRO_BATCH
    batches = [MicroBatch(input_ids[i:i + m], labels[i:i + m], mask[i:i + m], None, ids[i:i + m])
               for i in range(0, per_rank, m)]
    models = {"policy": _model(build_model, topo), "critic": _model(build_reward_model, topo)}
    objectives = {"critic": ValueObjective(cfg, table), "policy": PPOPolicyObjective(cfg, table)}
    out = {"table": (table.advantages, table.returns)}
    for _ in range(STEPS):
        for name in ("critic", "policy"):  # the trainer's order: PPOBatches.next_batch's critic step, then the policy's
            model, optimizer = models[name]
            result = train_step(model, optimizer, batches, topo, lr=OPTIM["lr"], clip=1.0, objective=objectives[name])
            out.setdefault(name, []).append((result.loss, result.grad_norm, result.metrics))
    for name, (model, _) in models.items():
        out[f"{name}_state"] = {k: v.float() for k, v in gather_full_state_dict(model, topo).items()}
    return out


def _ranks() -> dict:
    return {(layout, name): train(CONFIGS[name], *LAYOUTS[layout]) for layout in LAYOUTS for name in CONFIGS}


def _same_steps(got: list, ref: list, where: str) -> None:
    for step, ((loss, norm, metrics), (ref_loss, ref_norm, ref_metrics)) in enumerate(zip(got, ref, strict=True)):
        at = f"{where} step {step}"
        assert loss == pytest.approx(ref_loss, rel=1e-6, abs=FLOOR), f"{at} loss"
        assert norm == pytest.approx(ref_norm, rel=1e-6, abs=0), f"{at} grad_norm"
        assert metrics.keys() == ref_metrics.keys(), at
        for key in ref_metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=FLOOR), f"{at} {key}"


def test_one_dp_rank_alone_would_whiten_otherwise():
    """The check below can tell: each dp2 rank's rows whitened by themselves are far from the global whitening."""
    for cfg in CONFIGS.values():
        whole = rollout(cfg)[3]
        for rows in (slice(0, 4), slice(4, 8)):
            local = rollout(cfg, rows)[3]
            assert (local.advantages - whole.advantages[rows]).abs().max() > 0.1
            if cfg.whiten_rewards:  # whitened rewards feed the returns
                assert (local.returns - whole.returns[rows]).abs().max() > 0.1


def test_every_layout_steps_as_one_process():
    ranks = run_distributed(_ranks, world_size=2)
    cfg = H.tiny_config("llama", **MODEL)
    initial = {"policy": build_model(cfg).state_dict(), "critic": build_reward_model(cfg).state_dict()}
    for name, cfg in CONFIGS.items():
        ref = train(cfg, 1, 1, 1)
        assert all(metrics["clip_ratio"] > 0 for _, _, metrics in ref["policy"]), "the policy's ratios clip"
        assert all(metrics["vf_clipfrac"] > 0 for _, _, metrics in ref["critic"]), "the critic's values clip"
        for layout in LAYOUTS:
            for index, rank in enumerate(ranks):
                got, where = rank[(layout, name)], f"{layout} {name} rank {index}"
                rows = slice(index * 4, index * 4 + 4) if layout == "dp2" else slice(None)  # dp2: a prompt's 4 rows
                for got_t, ref_t in zip(got["table"], ref["table"]):
                    torch.testing.assert_close(got_t, ref_t[rows], rtol=1e-6, atol=1e-6, msg=where)
                for model in ("critic", "policy"):
                    _same_steps(got[model], ref[model], f"{where} {model}")
                    # pp: each rank gathers its stage's weights; the two together are the model's.
                    state = {k: v for r in ranks for k, v in r[(layout, name)][f"{model}_state"].items()}
                    for key, value in ref[f"{model}_state"].items():
                        diff = (state[key] - value).abs().max().item()
                        assert diff <= 1e-6 * value.abs().max().item(), f"{where} {model} {key}: {diff}"
                    assert any(not torch.equal(state[k], v.float()) for k, v in initial[model].items()), where
