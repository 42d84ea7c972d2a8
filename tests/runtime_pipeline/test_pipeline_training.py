"""Pipeline-parallel training equals single-process training: gloo processes on CPU, fp32, tiny 4-layer GPT (tied
embeddings) and Llama models. Per layout: the loss and grad norm of each of the harness's STEPS steps within 1e-5
relative, the validation loss (forward-only schedule) within 1e-5, every rank reporting the same loss, and the
parameters after them, gathered stage by stage, equal to the single-process model's by name. One spawn per world size.
"""
from __future__ import annotations

import functools

import pytest
import torch

from runtime.schema.model import MoEConfig
from tests.runtime_parallel import harness as H
from tests.runtime_pipeline import harness as P
from tests.runtime_parallel.dist_utils import run_distributed

L = P.PipelineLayout
MOE = MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02, router_z_loss_coef=0.001)
TWO_RANK_JOBS = {
    "gpt-pp2": ("gpt", {}, L(pp=2)),
    "llama-pp2": ("llama", {}, L(pp=2)),
    "gpt-pp2-vpp2": ("gpt", {}, L(pp=2, vpp=2)),
    "llama-pp2-vpp2": ("llama", {}, L(pp=2, vpp=2)),
    "gpt-pp2-uneven": ("gpt", {"num_layers": 3}, L(pp=2)),  # layers 0-1 | 2
    "llama-pp2-afab": ("llama", {}, L(pp=2, schedule="all_forward_all_backward")),
    # Mixtral: MoE layers on both stages, their auxiliary losses' gradients through the 1F1B schedule.
    "mixtral-pp2": ("llama", {"moe": MOE}, L(pp=2)),
    # Fine-tuning through the 1F1B schedule: every stage rebuilds the packed rows' attention mask from its batch.
    "llama-sft-pp2": ("llama", {"fine_tuning": "sft"}, L(pp=2)),
    "llama-lora-pp2-vpp2": ("llama", {"fine_tuning": "lora"}, L(pp=2, vpp=2)),
    # Preference alignment: the last stage computes the pair losses; LoRA's reference is scored through the
    # forward-only schedule with the adapters off, inside the step.
    "llama-dpo-pp2": ("llama", {"fine_tuning": "dpo"}, L(pp=2)),
    "llama-dpo-lora-pp2": ("llama", {"fine_tuning": "dpo-lora"}, L(pp=2)),
    # The Llama 3.1+ / Qwen switches with a tied head (Llama 3.2, small Qwen): the embedding on the first stage,
    # its tied head on the last.
    "families-tied-pp2": ("llama", {**H.FAMILY_SWITCHES, "share_embeddings_and_output_weights": True}, L(pp=2)),
    "qwen3moe-pp2": ("llama", H.QWEN3_MOE, L(pp=2)),  # a dense stage, then a sparse one
    # A source's vocabulary padded by us (101 of 128 rows): the last stage's loss, and LoRA's live reference scored
    # from the logits the forward-only schedule collects, both leave the padded logits out.
    "llama-padded-vocab-dpo-lora-pp2": ("llama", {"unpadded_vocab_size": 101, "fine_tuning": "dpo-lora"}, L(pp=2)),
}
FOUR_RANK_JOBS = {
    "gpt-pp4": ("gpt", {}, L(pp=4)),
    "llama-pp4": ("llama", {}, L(pp=4)),
    # NxD Training's model.pipeline_cuts: stages of 1, 3, 2 and 1 of 7 layers (the tied embedding and head on the
    # light first and last stages).
    "gpt-pp4-cuts": ("gpt", {"num_layers": 7}, L(pp=4, cuts=(0, 3, 5))),
    "llama-pp4-cuts": ("llama", {"num_layers": 7}, L(pp=4, cuts=(0, 3, 5))),
    "gpt-pp2-tp2-sp": ("gpt", {}, L(pp=2, tp=2, sequence_parallel=True)),
    "llama-pp2-tp2": ("llama", {}, L(pp=2, tp=2)),
    "gpt-pp2-dp2-zero1": ("gpt", {}, L(pp=2, dp=2, zero1=True)),
    "llama-pp2-dp2-zero1": ("llama", {}, L(pp=2, dp=2, zero1=True)),
    # Expert parallelism inside each pipeline stage (the EP group is the stage's two DP ranks), and interleaved.
    "mixtral-pp2-ep2": ("llama", {"moe": MOE}, L(pp=2, dp=2, ep=2)),
    "mixtral-pp2-vpp2-ep2-zero1": ("llama", {"moe": MOE}, L(pp=2, vpp=2, dp=2, ep=2, zero1=True)),
    # Context parallelism inside each stage: activations of half the sequence (chunks 0 and 3, or 1 and 2) cross
    # the stages, and the ring runs within each stage's two ranks.
    "gpt-pp2-cp2": ("gpt", {}, L(pp=2, dp=2, cp=2)),
    "llama-pp2-vpp2-cp2": ("llama", {}, L(pp=2, vpp=2, dp=2, cp=2)),
}
ALL_JOBS = {**TWO_RANK_JOBS, **FOUR_RANK_JOBS}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(P.run_suite, 2, args=(TWO_RANK_JOBS,))


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(P.run_suite, 4, args=(FOUR_RANK_JOBS,))


@functools.cache
def reference(arch: str, overrides: tuple) -> dict:
    torch.set_num_threads(1)
    return P.reference(arch, dict(overrides))


@pytest.fixture
def results(request):
    name = request.param
    ranks = request.getfixturevalue("two_ranks" if name in TWO_RANK_JOBS else "four_ranks")
    arch, overrides, _ = ALL_JOBS[name]
    return [r[name] for r in ranks], reference(arch, tuple(sorted(overrides.items())))


@pytest.mark.parametrize("results", list(ALL_JOBS), indirect=True)
@pytest.mark.long("its module fixture trains every pipeline layout under gloo once, shared by the module's tests")
def test_losses_match_single_process(results):
    ranks, ref = results
    for rank in ranks:
        assert rank["losses"] == ranks[0]["losses"], "every rank reports the same loss"
        assert rank["grad_norms"] == ranks[0]["grad_norms"], "every rank reports the same grad norm"
        H.assert_trains_as_reference(rank, ref)
    H.assert_learns(ref)


@pytest.mark.parametrize("results", list(ALL_JOBS), indirect=True)
def test_parameters_match_single_process(results):
    ranks, ref = results
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for name, value in rank["state"].items():
            # Replicas (DP, TP-replicated, and a tied embedding's first- and last-stage copies) stay identical.
            if name in merged:
                assert torch.equal(value, merged[name]), f"{name} differs between ranks"
            merged[name] = value
    assert merged.keys() == ref["state"].keys()
    for name, expected in ref["state"].items():
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["gpt-pp2-vpp2", "gpt-pp4", "gpt-pp4-cuts"])
def test_each_stage_holds_only_its_layers(name, two_ranks, four_ranks):
    ranks = [r[name] for r in (two_ranks if name in TWO_RANK_JOBS else four_ranks)]
    owners: dict[str, set[int]] = {}
    for rank in ranks:
        for key in rank["state"]:
            module = ".".join(key.split(".")[:2]) if key.startswith("layers.") else key
            owners.setdefault(module, set()).add(rank["pp_rank"])
    layer_owner = {k: v for k, v in owners.items() if k.startswith("layers.")}
    if name == "gpt-pp2-vpp2":  # stages 0..3 = rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1
        assert layer_owner == {"layers.0": {0}, "layers.1": {1}, "layers.2": {0}, "layers.3": {1}}
    elif name == "gpt-pp4-cuts":  # cuts after layers 0, 3 and 5
        assert layer_owner == {f"layers.{i}": {stage} for i, stage in enumerate([0, 1, 1, 1, 2, 2, 3])}
    else:
        assert layer_owner == {f"layers.{i}": {i} for i in range(4)}
    assert owners["embed.word.weight"] == {0}
    assert owners["output.weight"] == {max(r["pp_rank"] for r in ranks)}


@pytest.mark.parametrize("name", list(ALL_JOBS))
def test_no_parameter_carries_parallel_state(name, two_ranks, four_ranks):
    for rank in (two_ranks if name in TWO_RANK_JOBS else four_ranks):
        assert rank[name]["parameter_attributes"] == [], "parallel state belongs in the plan, not on parameters"


def test_the_plan_records_shards_replicas_and_ties(four_ranks):
    """gpt-pp2-tp2-sp: tied embedding split by vocabulary over TP and copied on the first and last stage; norm
    weights replicated over TP with partial (sequence-shard) gradients."""
    for rank in four_ranks:
        plan = rank["gpt-pp2-tp2-sp"]["plan"]
        tied = "embed.word.weight" if rank["gpt-pp2-tp2-sp"]["pp_rank"] == 0 else "output.weight"
        assert plan[tied] == {"sharded": True, "tp_copies": 1, "partial_grad": False, "pipeline_tied": True}
        norms = [name for name in plan if "norm" in name]
        assert norms and all(plan[n] == {"sharded": False, "tp_copies": 2, "partial_grad": True,
                                         "pipeline_tied": False} for n in norms)
        assert plan["layers.1.attn.qkv.weight" if rank["gpt-pp2-tp2-sp"]["pp_rank"] == 0
                    else "layers.3.attn.qkv.weight"]["sharded"]
