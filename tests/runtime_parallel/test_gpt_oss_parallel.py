"""GPT-OSS (harness.GPT_OSS) trains under tp2 (with and without sequence parallelism), ep2 and pp2 exactly as one
process does: gloo processes on CPU, fp32; per step the loss and grad norm within 1e-5 relative, and the parameters
after the steps (sinks split by head, experts by expert and by interleaved gate/up pairs, their biases with them,
down_bias whole) within 1e-5. Context parallelism is refused in one line. One spawn for tp/ep, one for pp."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from runtime.models import build_model
from runtime.parallel import ParallelDims, Topology, parallelize_model
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_pipeline import harness as P

L = H.Layout
JOBS = {
    "gptoss-tp2": ("llama", H.GPT_OSS, L(tp=2)),
    "gptoss-tp2-sp": ("llama", H.GPT_OSS, L(tp=2, sequence_parallel=True)),
    "gptoss-ep2": ("llama", H.GPT_OSS, L(dp=2, ep=2)),
    # With a capacity (the trn1 recipes' fixed expert batches): the same assignments dropped, down_bias added once.
    "gptoss-capacity-ep2": ("llama", {**H.GPT_OSS, "moe": dataclasses.replace(H.GPT_OSS["moe"], capacity_factor=0.65)},
                            L(dp=2, ep=2)),
    "gptoss-capacity-tp2-sp": ("llama", {**H.GPT_OSS, "moe": dataclasses.replace(H.GPT_OSS["moe"],
                                                                                capacity_factor=0.65)},
                               L(tp=2, sequence_parallel=True)),
    # LoRA on the attention's q, k, v and o (biased projections), sharded with them; the base frozen.
    "gptoss-lora-tp2-sp": ("llama", {**H.GPT_OSS, "fine_tuning": "lora"}, L(tp=2, sequence_parallel=True)),
}
# The pipeline harness's 4 layers: sliding and full alternating, one of each on each stage.
PIPELINE = {**H.GPT_OSS, "layer_types": ("sliding_attention", "full_attention") * (P.NUM_LAYERS // 2)}
PIPELINE_JOBS = {"gptoss-pp2": ("llama", PIPELINE, P.PipelineLayout(pp=2))}


def layout_suite(jobs: dict, pipeline_jobs: dict, pipeline: dict):
    """A family's two-rank layouts (`jobs`) and pipeline layouts (`pipeline_jobs`, on the `pipeline` overrides): the
    module fixtures that train each under gloo once, and the tests that each trains as one process does (a test
    module takes them by name: globals().update(layout_suite(...)))."""

    @pytest.fixture(scope="module")
    def two_ranks():
        return run_distributed(H.run_suite, 2, args=(jobs,))

    @pytest.fixture(scope="module")
    def pipeline_ranks():
        return run_distributed(P.run_suite, 2, args=(pipeline_jobs,))

    @functools.cache
    def reference(name: str) -> dict:
        torch.set_num_threads(1)
        if name in pipeline_jobs:
            return P.reference("llama", pipeline)
        return H.train_job("llama", jobs[name][1], L())

    @pytest.mark.parametrize("name", list(jobs))
    @pytest.mark.long("its module fixture trains every layout under gloo once")
    def test_layout_trains_as_one_process(name, two_ranks):
        _assert_same([r[name] for r in two_ranks], reference(name))

    @pytest.mark.parametrize("name", list(pipeline_jobs))
    @pytest.mark.long("its module fixture trains the pipeline layout under gloo once")
    def test_pipeline_trains_as_one_process(name, pipeline_ranks):
        _assert_same([r[name] for r in pipeline_ranks], reference(name))

    return {"two_ranks": two_ranks, "pipeline_ranks": pipeline_ranks,
            "test_layout_trains_as_one_process": test_layout_trains_as_one_process,
            "test_pipeline_trains_as_one_process": test_pipeline_trains_as_one_process}


def _assert_same(ranks: list[dict], ref: dict) -> None:
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        assert rank["losses"] == ranks[0]["losses"], "every rank reports the same loss"
        H.assert_trains_as_reference(rank, ref)
        if "dropped" in rank:  # with a capacity: the same assignments dropped (the pipeline harness omits it)
            assert rank["dropped"] == ref["dropped"]
        for name, value in rank["state"].items():
            if name in merged:  # replicas (and a pipeline's stages, each its own names) never drift apart
                assert torch.equal(value, merged[name]), f"{name} differs between ranks"
            merged[name] = value
    assert merged.keys() == ref["state"].keys()
    for name, expected in ref["state"].items():
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-5, msg=name)
    H.assert_learns(ref)


globals().update(layout_suite(JOBS, PIPELINE_JOBS, PIPELINE))


def test_context_parallel_refused_in_one_line():
    topo = Topology.offline(ParallelDims(tp=1, pp=1, dp=2, world_size=2, cp=2), rank=0)  # refused before any group
    with pytest.raises(ValueError, match=r"^training\.model\.context_parallel_size: 2 with sliding-window layers[^\n]*$"):
        parallelize_model(build_model(H.tiny_config("llama", **H.GPT_OSS)), topo)
    full = {**H.GPT_OSS, "sliding_window": None, "layer_types": ("full_attention", "full_attention")}
    with pytest.raises(ValueError, match=r"^training\.model\.context_parallel_size: 2 with attention sinks[^\n]*$"):
        parallelize_model(build_model(H.tiny_config("llama", **full)), topo)
