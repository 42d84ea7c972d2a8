"""Gemma 3 (runtime/families/gemma3) trains under tensor and pipeline parallelism exactly as in one process: gloo
processes on CPU, fp32, the harness's tiny Gemma 3 (sliding-window and full layers, sandwich norms, GeGLU, q/k norms,
a tied head). One spawn of 2 ranks trains every layout; each layout's losses, grad norms and final parameters are
compared with the single-process run as tests/runtime_parallel/test_parallel_training.py does. Context parallelism
has no sliding window: it is refused in one line naming the key."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from runtime.models import build_model
from runtime.parallel import parallelize_model
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_pipeline import harness as P

JOBS = {
    "gemma3-tp2": ("gemma3", {}, H.Layout(tp=2)),
    "gemma3-tp2-sp": ("gemma3", {}, H.Layout(tp=2, sequence_parallel=True)),
    # Packed fine-tuning rows: each example's own causal mask and the window, both.
    "gemma3-sft-tp2-sp": ("gemma3", {"fine_tuning": "sft"}, H.Layout(tp=2, sequence_parallel=True)),
    "gemma3-lora-tp2-sp": ("gemma3", {"fine_tuning": "lora"}, H.Layout(tp=2, sequence_parallel=True)),
    "gemma3-dp2-zero1": ("gemma3", {}, H.Layout(dp=2, zero1=True)),
}
PIPELINE_JOBS = {"gemma3-pp2": ("gemma3", {}, P.PipelineLayout(pp=2))}


def _suites() -> dict:
    return {**H.run_suite(JOBS), **P.run_suite(PIPELINE_JOBS)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_suites, 2)


@functools.cache
def reference(name: str) -> dict:
    torch.set_num_threads(1)
    if name in PIPELINE_JOBS:
        arch, overrides, _ = PIPELINE_JOBS[name]
        return P.reference(arch, overrides)
    arch, overrides, _ = JOBS[name]
    return H.train_job(arch, overrides, H.Layout())


@pytest.mark.parametrize("name", [*JOBS, *PIPELINE_JOBS])
def test_layout_matches_single_process(two_ranks, name):
    ranks, ref = [r[name] for r in two_ranks], reference(name)
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["losses"], dtype=torch.float64),
                                   torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(rank["grad_norms"]), torch.tensor(ref["grad_norms"]),
                                   rtol=1e-5, atol=0)
    if name in JOBS:
        for rank in ranks:
            for key, expected in ref["state"].items():
                torch.testing.assert_close(rank["state"][key], expected, rtol=1e-5, atol=1e-5, msg=key)
    H.assert_learns(ref)


def test_context_parallel_with_a_sliding_window_is_refused():
    """Before anything is sharded: the topology's sizes are all parallelize_model reads before it refuses."""
    model = build_model(H.tiny_config("gemma3"))
    axis = lambda size: SimpleNamespace(size=size, rank=0)  # noqa: E731
    topo = SimpleNamespace(tp=axis(1), pp=axis(1), ep=axis(1), cp=axis(2))
    with pytest.raises(ValueError, match=r"^training\.model\.context_parallel_size: 2 with sliding-window layers"):
        parallelize_model(model, topo)
    with pytest.raises(ValueError, match=r"^training\.model\.ulysses_parallel_size: 2 with sliding-window layers"):
        parallelize_model(model, topo, context="ulysses")
