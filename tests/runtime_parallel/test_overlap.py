"""Gradient reduction overlapped with backward (runtime/parallel/data_parallel.py), in real gloo processes.

Overlap changes when each bucket's collective starts, never what it sums: the same losses and weights bit for bit
with overlap on and off. The buckets do start during backward, and only in the last micro-batch's backward
(gradient accumulation reduces once per step); a step that runs more backward passes than it announced stops
with an error instead of racing a collective that is reading the buffer.
"""
from __future__ import annotations

import pytest
import torch

from runtime.parallel import DataParallelConfig, ShardedAdamW, gather_full_state_dict, parallelize_model
from runtime.schema.model import MoEConfig
from runtime.step import train_step
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

STEPS = 3
MOE = MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02)
JOBS = {
    "gpt-dp2": ("gpt", {}, H.Layout(dp=2)),
    "llama-dp2-zero1": ("llama", {}, H.Layout(dp=2, zero1=True)),
    "mixtral-ep2-zero1": ("llama", {"moe": MOE}, H.Layout(dp=2, ep=2, zero1=True)),  # expert buckets over edp
}


def _train(arch: str, overrides: dict, layout: H.Layout, overlap: bool) -> dict:
    topo = H.make_topology(layout)
    model = parallelize_model(H.fine_tuning_model(H.tiny_config(arch, **overrides), None), topo,
                              data_parallel=DataParallelConfig("fp32", layout.zero1, bucket_numel=H.BUCKET_NUMEL,
                                                               overlap_grad_reduce=overlap,
                                                               overlap_param_gather=overlap))
    dp = model.data_parallel
    optimizer = ShardedAdamW(model, H.OPTIM)
    forwards, in_reduce, starts = [0], [False], []
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    start, reduce = dp._start, dp.reduce_gradients

    def recording_start(bucket):
        starts.append((forwards[0], in_reduce[0]))
        start(bucket)

    def recording_reduce():
        in_reduce[0] = True
        reduce()
        in_reduce[0] = False

    dp._start, dp.reduce_gradients = recording_start, recording_reduce
    losses, micro_batches = [], 0
    for step in range(STEPS):
        forwards[0] = 0
        batches, _ = H.step_inputs(None, step, H.TINY[arch]["vocab_size"], topo)
        micro_batches = len(batches)
        losses.append(train_step(model, optimizer, batches, topo, lr=H.OPTIM["lr"], clip=1.0).loss)
    return {"losses": losses, "state": gather_full_state_dict(model, topo), "starts": starts,
            "micro_batches": micro_batches, "early_buckets": len(dp._early)}


def _misuse() -> str:
    """Announce one micro-batch, run two backward passes: the second must be refused."""
    layout = H.Layout(dp=2)
    topo = H.make_topology(layout)
    model = parallelize_model(H.fine_tuning_model(H.tiny_config("gpt"), None), topo,
                              data_parallel=DataParallelConfig("fp32", bucket_numel=H.BUCKET_NUMEL,
                                                               overlap_grad_reduce=True))
    input_ids, labels, _mask, *_ = H.step_inputs(None, 0, H.TINY["gpt"]["vocab_size"], topo)[0][0]
    model.data_parallel.zero_grad(1)
    model(input_ids, labels).sum().backward()
    try:
        model(input_ids, labels).sum().backward()
    except RuntimeError as error:
        return str(error)
    finally:
        model.data_parallel.reduce_gradients()  # finish what did start, so the process group ends clean
    return "no error"


def _suite() -> dict:
    out = {name: {overlap: _train(arch, overrides, layout, overlap) for overlap in (True, False)}
           for name, (arch, overrides, layout) in JOBS.items()}
    out["misuse"] = _misuse()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_suite, 2)


@pytest.mark.parametrize("name", list(JOBS))
def test_overlap_on_and_off_are_bitwise_equal(ranks, name):
    for rank in ranks:
        on, off = rank[name][True], rank[name][False]
        assert on["losses"] == off["losses"]
        assert on["state"].keys() == off["state"].keys()
        for key in on["state"]:
            assert torch.equal(on["state"][key], off["state"][key]), key


@pytest.mark.parametrize("name", list(JOBS))
def test_buckets_start_during_the_last_backward_only(ranks, name):
    for rank in ranks:
        on, off = rank[name][True], rank[name][False]
        assert on["micro_batches"] >= 2, "the test needs gradient accumulation"
        assert on["early_buckets"] >= 4, "the test needs several buckets"
        during = [forwards for forwards, in_reduce in on["starts"] if not in_reduce]
        # Every early bucket but the one holding the first layer's (last-ready) gradients starts in backward.
        assert len(during) >= STEPS * (on["early_buckets"] - 1)
        assert set(during) == {on["micro_batches"]}, "a bucket started before the last micro-batch's backward"
        assert all(in_reduce for _, in_reduce in off["starts"]), "overlap off still started buckets in backward"
        assert len(off["starts"]) == len(on["starts"])


def test_more_backward_passes_than_announced_are_refused(ranks):
    for rank in ranks:
        assert "a gradient arrived after its bucket's reduction started" in rank["misuse"]
