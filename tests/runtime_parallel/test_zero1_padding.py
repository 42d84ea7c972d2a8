"""ZeRO-1 where a bucket is smaller than the data-parallel size: rank 3 of 4 owns only padding of a 5-element
bucket (shards of ceil(5 / 4) = 2). It still takes part in every all-gather, and every rank ends with the weights
a single process gets from torch.optim.AdamW. Real gloo processes on CPU."""
from __future__ import annotations

import torch
from torch import nn

from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, apply_data_parallel
from tests.runtime_parallel.dist_utils import run_distributed

DP, STEPS, LR = 4, 3, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 1, bias=False)  # one 5-element parameter, one bucket


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=gen), torch.randn(8, 1, generator=gen)


def _train_zero1() -> dict:
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=DP, world_size=DP))
    model = apply_data_parallel(_model(), topo, DataParallelConfig(zero1=True))
    shard = model.data_parallel.buckets[0].shard
    optimizer = ShardedAdamW(model, {"lr": LR})
    for step in range(STEPS):
        x, y = _batch(step)
        model.data_parallel.zero_grad()
        # Every rank sees the whole batch and contributes a quarter: the DP sum is the full-batch gradient.
        (((model(x) - y) ** 2).mean() / DP).backward()
        model.data_parallel.reduce_gradients()
        optimizer.clip_grad_norm(None)
        optimizer.step()
    return {"weight": model.weight.detach().clone(), "shard": (shard.start, shard.stop)}


def test_a_shard_of_only_padding_still_joins_the_all_gather():
    results = run_distributed(_train_zero1, DP, timeout_s=60)
    assert results[DP - 1]["shard"] == (6, 8), "rank 3 owns elements 6-7 of a 5-element bucket: only padding"
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        optimizer.step()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["weight"], reference.weight.detach(), rtol=1e-6, atol=1e-7,
                                   msg=f"rank {rank}")
