"""ShardedAdamW, data parallelism's buffers and train_step in one process: AdamW math, decay groups, clipping, hooks."""
from __future__ import annotations

import copy

import pytest
import torch

from runtime.models import build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, apply_data_parallel
from runtime.step import eval_step, train_step
from tests.runtime_parallel import harness as H

SOLO = ParallelDims(1, 1, 1, 1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "reference-math"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_matches_torch_adamw_with_megatron_decay_groups(clip, fused):
    topo = Topology.build(SOLO)
    ours = build_model(H.tiny_config("gpt"))
    theirs = copy.deepcopy(ours)
    optimizer = ShardedAdamW(apply_data_parallel(ours, topo, DataParallelConfig("fp32")), H.OPTIM)
    optimizer.rule.fused = fused  # the fallback for devices without torch._fused_adamw_
    decay = [p for p in theirs.parameters() if p.dim() > 1]
    no_decay = [p for p in theirs.parameters() if p.dim() <= 1]
    reference = torch.optim.AdamW([{"params": decay, "weight_decay": H.OPTIM["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=H.OPTIM["lr"], betas=H.OPTIM["betas"], eps=H.OPTIM["eps"])
    for step in range(4):
        batches = H.micro_batches_for(step, 128, topo)
        result = train_step(ours, optimizer, batches, topo, lr=H.OPTIM["lr"], clip=clip)
        reference.zero_grad()
        tokens = sum(mask.sum() for _, _, mask in batches)
        loss = sum((theirs(x, y) * mask).sum() for x, y, mask in batches) / tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), clip if clip else float("inf"))
        reference.step()
        assert result.loss == pytest.approx(loss.item(), rel=1e-6)
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    theirs_by_name = dict(theirs.named_parameters(remove_duplicate=False))
    for name, a in ours.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(a, theirs_by_name[name], rtol=1e-5, atol=1e-6, msg=name)


def test_mixed_precision_keeps_fp32_master_weights():
    topo = Topology.build(SOLO)
    model = build_model(H.tiny_config("gpt"))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = ShardedAdamW(apply_data_parallel(model, topo, DataParallelConfig("mixed_precision")), H.OPTIM)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    masters = torch.cat([b.master for b in optimizer.data_parallel.buckets])
    assert masters.dtype == torch.float32
    assert masters.numel() == sum(p.numel() for p in full.values()), "one fp32 copy of every weight"
    assert sorted(masters.tolist()) == sorted(torch.cat([p.reshape(-1) for p in full.values()]).tolist())
    bf16 = apply_data_parallel(build_model(H.tiny_config("gpt")), topo, DataParallelConfig("bf16SR"))
    assert all(b.master is None for b in bf16.data_parallel.buckets)


def test_state_dict_round_trip_resumes_exactly():
    topo = Topology.build(SOLO)

    def run(model, optimizer, steps):
        return [train_step(model, optimizer, H.micro_batches_for(s, 128, topo), topo, lr=1e-3, clip=1.0).loss
                for s in steps]

    model = build_model(H.tiny_config("llama"))
    optimizer = ShardedAdamW(apply_data_parallel(model, topo, DataParallelConfig("mixed_precisionSR")), H.OPTIM)
    run(model, optimizer, range(3))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    expected = run(model, optimizer, range(3, 6))

    resumed = build_model(H.tiny_config("llama"))
    resumed_opt = ShardedAdamW(apply_data_parallel(resumed, topo, DataParallelConfig("mixed_precisionSR")),
                               H.OPTIM)
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    assert run(resumed, resumed_opt, range(3, 6)) == expected


def test_train_step_rejects_malformed_micro_batches():
    topo = Topology.build(SOLO)
    model = build_model(H.tiny_config("gpt"))
    optimizer = ShardedAdamW(apply_data_parallel(model, topo, DataParallelConfig()), H.OPTIM)
    x = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\(input_ids, labels, loss_mask\[, position_ids\[, pair_ids\]\]\)"):
        train_step(model, optimizer, [(x, x)], topo, lr=1e-3, clip=1.0)
    assert eval_step(model, [(x, x, None)], topo) > 0
    # The step's figures stay on the device until read (one read, after the step's graph on XLA): the read refuses,
    # before the loop goes on to anything else (the update it made divided by zero tokens).
    result = train_step(model, optimizer, [(x, x, torch.zeros(2, 8))], topo, lr=1e-3, clip=1.0)
    with pytest.raises(ValueError, match="every loss_mask"):
        result.read()


def test_tied_embedding_stays_tied_through_training():
    topo = Topology.build(SOLO)
    model = build_model(H.tiny_config("gpt"))
    optimizer = ShardedAdamW(apply_data_parallel(model, topo, DataParallelConfig()), H.OPTIM)
    for step in range(3):
        train_step(model, optimizer, H.micro_batches_for(step, 128, topo), topo, lr=1e-3, clip=1.0)
    assert model.embed.word.weight.data_ptr() == model.output.weight.data_ptr()
    assert torch.equal(model.embed.word.weight, model.output.weight)


def test_dropout_trains_and_eval_is_deterministic():
    topo = Topology.build(SOLO)
    model = build_model(H.tiny_config("llama", hidden_dropout=0.1, attention_dropout=0.1))
    optimizer = ShardedAdamW(apply_data_parallel(model, topo, DataParallelConfig()), H.OPTIM)
    batches = H.micro_batches_for(0, 128, topo)
    losses = [train_step(model, optimizer, batches, topo, lr=3e-3, clip=1.0).loss for _ in range(5)]
    assert losses[-1] < losses[0]
    assert eval_step(model, batches, topo) == eval_step(model, batches, topo)
