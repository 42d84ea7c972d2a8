"""GRPO's update under tensor, data and pipeline parallelism (2 real gloo ranks each) against one process, on the
same fixed rollout (tests/rl/fixed.py) trained twice (the second step's ratios are off 1 for real): every step's
loss, metrics and grad norm, and the weights after the updates, within 1e-6 relative."""
from __future__ import annotations

import pytest
import torch

from runtime.device import flash_attention_kernels
from runtime.micro_batch import MicroBatch
from runtime.models import build_model
from runtime.parallel import (DataParallelConfig, ParallelDims, ShardedAdamW, Topology, gather_full_state_dict,
                              parallelize_model)
from runtime.rl.grpo import GRPOConfig, GRPOObjective
from runtime.step import train_step
from tests.rl import fixed as F
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

STEPS = 2
# Adam's eps at 1e-3 rather than the harness's 1e-6: Adam divides each gradient by its own running size, so the float
# noise of the gradients that are mathematically near zero (summed in a different order by every layout) would move
# their weights by a full lr-sized step; a larger eps keeps such a step as small as its gradient, so comparing the
# weights measures the sharding at 1e-6, not rounding.
OPTIM = {**H.OPTIM, "eps": 1e-3}
LAYOUTS = {"tp2": (2, 1, 1), "dp2": (1, 1, 2), "pp2": (1, 2, 1)}  # (tp, pp, dp)
LOSSES = {
    "grpo": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, loss_type="grpo"),
    "bnpo": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, loss_type="bnpo"),
    "dr_grpo": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, loss_type="dr_grpo",
                          beta=0.04, epsilon_high=0.28),
    "dapo-kl-masked": GRPOConfig(num_generations=F.G, max_completion_length=F.MAX_COMPLETION, beta=0.04,
                                 mask_truncated_completions=True),
}


def train(cfg: GRPOConfig, tp: int, pp: int, dp: int) -> dict:
    topo = Topology.build(ParallelDims(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp))
    model = parallelize_model(build_model(H.tiny_config("llama", num_layers=4, init_method_std=0.1)), topo,
                              data_parallel=DataParallelConfig("fp32", False, bucket_numel=H.BUCKET_NUMEL),
                              attention_kernels=flash_attention_kernels)
    optimizer = ShardedAdamW(model, OPTIM)
    per_rank = len(F.COMPLETIONS) // topo.data_size
    rows = slice(topo.data_rank * per_rank, (topo.data_rank + 1) * per_rank)
    input_ids, labels, mask = (t[rows] for t in F.rows(cfg.mask_truncated_completions)[:3])
    objective = GRPOObjective(cfg, F.table(cfg.scale_rewards, cfg.mask_truncated_completions, rows))
    ids = torch.arange(per_rank)
    batches = [MicroBatch(input_ids[i:i + F.MICRO_BATCH], labels[i:i + F.MICRO_BATCH], mask[i:i + F.MICRO_BATCH],
                          None, ids[i:i + F.MICRO_BATCH]) for i in range(0, per_rank, F.MICRO_BATCH)]
    losses, norms, metrics = [], [], []
    for _ in range(STEPS):
        result = train_step(model, optimizer, batches, topo, lr=OPTIM["lr"], clip=1.0, objective=objective)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        metrics.append(result.metrics)
    state = {k: v.float() for k, v in gather_full_state_dict(model, topo).items()}
    return {"losses": losses, "grad_norms": norms, "metrics": metrics, "state": state}


def _ranks() -> dict:
    return {(layout, loss): train(LOSSES[loss], *LAYOUTS[layout]) for layout in LAYOUTS for loss in LOSSES}


def test_every_layout_trains_as_one_process():
    ranks = run_distributed(_ranks, world_size=2)
    initial = {k: v.float() for k, v in build_model(H.tiny_config("llama", num_layers=4,
                                                                  init_method_std=0.1)).state_dict().items()}
    for loss, cfg in LOSSES.items():
        ref = train(cfg, 1, 1, 1)
        assert ref["metrics"][1]["clip_ratio"] > 0, "the second step clips some ratios"
        for layout in LAYOUTS:
            for rank in ranks:
                got = rank[(layout, loss)]
                where = f"{layout} {loss}"
                torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                           torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-6, atol=1e-9,
                                           msg=where)
                torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]),
                                           rtol=1e-6, atol=0, msg=where)
                for step, (g, r) in enumerate(zip(got["metrics"], ref["metrics"])):
                    assert g.keys() == r.keys()
                    for name in r:
                        assert g[name] == pytest.approx(r[name], rel=1e-6, abs=1e-9), f"{where} step {step} {name}"
                state = {k: v for r in ranks for k, v in r[(layout, loss)]["state"].items()}  # pp: a stage each
                for name, value in ref["state"].items():
                    # Within 1e-6 of the weights' size (a few float32 steps of a norm weight at 1.0).
                    diff = (state[name] - value).abs().max().item()
                    assert diff <= 1e-6 * value.abs().max().item(), f"{where} {name}: {diff}"
                assert any(not torch.equal(state[name], initial[name]) for name in initial), where
