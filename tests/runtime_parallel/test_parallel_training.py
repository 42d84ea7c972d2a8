"""Distributed training equals single-process training: gloo processes on CPU, fp32, tiny GPT and Llama models.

For each layout, loss at each of the harness's STEPS steps matches the single-process run within 1e-5 relative and
the full (TP-gathered) parameters after them within 1e-5. Two spawns serve the whole module (one of 2 ranks, one of 4).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from runtime.schema.model import MoEConfig
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

L = H.Layout
# Mixtral: every layer's MLP a sparse MoE block, with both auxiliary losses on (their gradients must average over
# micro-batches and ranks exactly as the token loss does); dropless, and with a capacity that drops tokens.
MOE = MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02, router_z_loss_coef=0.001)
# 0.65: each expert takes 11 of a micro-batch's 64 assignments (an odd capacity, which tp=2 pads to split it).
MOE_CAPACITY = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.65, router_aux_loss_coef=0.02)
TWO_RANK_JOBS = {
    f"{arch}-{name}": (arch, {}, layout)
    for arch in ("gpt", "llama")
    for name, layout in [("tp2", L(tp=2)), ("tp2-sp", L(tp=2, sequence_parallel=True)), ("dp2", L(dp=2)),
                         ("dp2-zero1", L(dp=2, zero1=True))]
}
TWO_RANK_JOBS.update({
    # GQA with tp (2) > KV heads (1): each rank keeps a replica of the single KV head.
    "llama-kv1-tp2-sp": ("llama", {"num_query_groups": 1}, L(tp=2, sequence_parallel=True)),
    # Activation checkpointing, with recomputed forwards that themselves contain TP collectives.
    "gpt-tp2-sp-full-ckpt": ("gpt", {}, L(tp=2, sequence_parallel=True, activation_checkpointing="full")),
    "llama-tp2-selective-ckpt": ("llama", {}, L(tp=2, activation_checkpointing="selective",
                                               recompute_modules=("core_attention", "mlp"))),
    "mixtral-dp2": ("llama", {"moe": MOE}, L(dp=2)),
    "mixtral-dp2-zero1": ("llama", {"moe": MOE}, L(dp=2, zero1=True)),
    "mixtral-capacity-dp2": ("llama", {"moe": MOE_CAPACITY}, L(dp=2)),
    # Expert parallelism: each rank holds 2 of the 4 experts; tokens cross by all-to-all.
    "mixtral-ep2": ("llama", {"moe": MOE}, L(dp=2, ep=2)),
    "mixtral-ep2-zero1": ("llama", {"moe": MOE}, L(dp=2, ep=2, zero1=True)),
    "mixtral-capacity-ep2": ("llama", {"moe": MOE_CAPACITY}, L(dp=2, ep=2)),
    # Experts split by TP (hidden units) with the router whole on both ranks; with SP the block gathers the sequence.
    "mixtral-tp2-sp": ("llama", {"moe": MOE}, L(tp=2, sequence_parallel=True)),
    # Long context: each sample's sequence split over both ranks. Ring attention (chunks 0+3 and 1+2)...
    "gpt-cp2": ("gpt", {}, L(cp=2)),
    "llama-cp2": ("llama", {}, L(cp=2)),
    # ...and Ulysses (GQA's two KV heads split between the ranks; one KV head is replicated to both).
    "gpt-ulysses2": ("gpt", {}, L(ulysses=2)),
    "llama-ulysses2": ("llama", {}, L(ulysses=2)),
    "llama-kv1-ulysses2": ("llama", {"num_query_groups": 1}, L(ulysses=2)),
    # Pretraining rows with separated documents (reset_position_ids/reset_attention_mask) split over the group:
    # each rank masks its blocks by the whole row's documents.
    "gpt-documents-cp2": ("gpt", {"fine_tuning": "documents"}, L(cp=2)),
    "llama-documents-ulysses2": ("llama", {"fine_tuning": "documents"}, L(ulysses=2)),
    # Fine-tuning: packed rows (attention reset per example, loss on part of each) with every weight training,
    # and LoRA (frozen base, adapters on every projection; sharded with their base layers).
    "llama-sft-tp2-sp": ("llama", {"fine_tuning": "sft"}, L(tp=2, sequence_parallel=True)),
    "llama-sft-dp2-zero1": ("llama", {"fine_tuning": "sft"}, L(dp=2, zero1=True)),
    "llama-lora-tp2-sp": ("llama", {"fine_tuning": "lora"}, L(tp=2, sequence_parallel=True)),
    "llama-lora-tp2": ("llama", {"fine_tuning": "lora"}, L(tp=2)),
    "llama-lora-dp2-zero1": ("llama", {"fine_tuning": "lora"}, L(dp=2, zero1=True)),
    "gpt-lora-tp2-sp": ("gpt", {"fine_tuning": "lora"}, L(tp=2, sequence_parallel=True)),
    # Preference alignment: a pair's chosen and rejected rows in one micro-batch, the loss a sum over pairs divided
    # by the global pair count. Full-parameter against a reference table, LoRA against its base (adapters off,
    # scored inside the step under the same layout); IPO and ORPO (NLL over the global chosen tokens) once each.
    "llama-dpo-tp2-sp": ("llama", {"fine_tuning": "dpo"}, L(tp=2, sequence_parallel=True)),
    "llama-dpo-dp2-zero1": ("llama", {"fine_tuning": "dpo"}, L(dp=2, zero1=True)),
    "llama-dpo-lora-tp2-sp": ("llama", {"fine_tuning": "dpo-lora"}, L(tp=2, sequence_parallel=True)),
    "llama-dpo-lora-dp2-zero1": ("llama", {"fine_tuning": "dpo-lora"}, L(dp=2, zero1=True)),
    "llama-ipo-tp2-sp": ("llama", {"fine_tuning": "ipo"}, L(tp=2, sequence_parallel=True)),
    "llama-orpo-dp2-zero1": ("llama", {"fine_tuning": "orpo"}, L(dp=2, zero1=True)),
    # The Llama 3.1+ / Qwen switches (harness.FAMILY_SWITCHES): q/k norm weights shared by the heads of both
    # ranks (and by the replicas of a single KV head), a head size of its own, q/k/v biases, scaled RoPE.
    "families-tp2-sp": ("llama", H.FAMILY_SWITCHES, L(tp=2, sequence_parallel=True)),
    "families-kv1-tp2": ("llama", {**H.FAMILY_SWITCHES, "num_query_groups": 1}, L(tp=2)),
    "families-dp2-zero1": ("llama", H.FAMILY_SWITCHES, L(dp=2, zero1=True)),
    "families-cp2": ("llama", H.FAMILY_SWITCHES, L(cp=2)),
    "families-lora-tp2-sp": ("llama", {**H.FAMILY_SWITCHES, "fine_tuning": "lora"}, L(tp=2, sequence_parallel=True)),
    # A source's vocabulary padded by us (ModelConfig.unpadded_vocab_size: 101 of 128 rows, GPT-2's 60 of 128,
    # which leaves rank 1's half of the vocabulary all padding): each rank masks its own padded logits.
    "llama-padded-vocab-tp2": ("llama", {"unpadded_vocab_size": 101}, L(tp=2)),
    "gpt-padded-vocab-tp2-sp": ("gpt", {"unpadded_vocab_size": 60}, L(tp=2, sequence_parallel=True)),
    # Qwen3-MoE: experts of their own size, top_k weights not renormalized, layer 0 dense and layer 1 sparse.
    "qwen3moe-ep2": ("llama", H.QWEN3_MOE, L(dp=2, ep=2)),
    "qwen3moe-tp2-sp": ("llama", H.QWEN3_MOE, L(tp=2, sequence_parallel=True)),
    "qwen3moe-dp2-zero1": ("llama", H.QWEN3_MOE, L(dp=2, zero1=True)),
})
FOUR_RANK_JOBS = {
    "gpt-tp2-dp2": ("gpt", {}, L(tp=2, dp=2)),
    "llama-tp2-dp2": ("llama", {}, L(tp=2, dp=2)),
    "gpt-tp2-dp2-sp-zero1": ("gpt", {}, L(tp=2, dp=2, sequence_parallel=True, zero1=True)),
    "llama-tp2-dp2-sp-zero1": ("llama", {}, L(tp=2, dp=2, sequence_parallel=True, zero1=True)),
    # tp (4) > KV heads (2): pairs of ranks share a KV head.
    "llama-tp4-sp": ("llama", {}, L(tp=4, sequence_parallel=True)),
    "mixtral-ep2-tp2": ("llama", {"moe": MOE}, L(tp=2, dp=2, ep=2)),
    "mixtral-capacity-ep2-tp2-sp-zero1": ("llama", {"moe": MOE_CAPACITY},
                                          L(tp=2, dp=2, ep=2, sequence_parallel=True, zero1=True)),
    "gpt-cp2-tp2-sp": ("gpt", {}, L(cp=2, tp=2, sequence_parallel=True)),
    "llama-cp2-tp2": ("llama", {}, L(cp=2, tp=2)),
    "gpt-cp2-dp2-zero1": ("gpt", {}, L(cp=2, dp=2, zero1=True)),
    "llama-documents-cp2-tp2-sp": ("llama", {"fine_tuning": "documents"}, L(cp=2, tp=2, sequence_parallel=True)),
    # The ring recomputed in backward (selective recompute of core attention) still sums the same gradients.
    "llama-cp2-dp2-zero1-selective": ("llama", {}, L(cp=2, dp=2, zero1=True, activation_checkpointing="selective")),
    "llama-cp4": ("llama", {}, L(cp=4)),
    "gpt-ulysses2-dp2": ("gpt", {}, L(ulysses=2, dp=2)),
    "llama-ulysses2-dp2": ("llama", {}, L(ulysses=2, dp=2)),
    "llama-ulysses2-tp2-sp": ("llama", {}, L(ulysses=2, tp=2, sequence_parallel=True)),
    "llama-lora-tp2-dp2-sp-zero1": ("llama", {"fine_tuning": "lora"},
                                           L(tp=2, dp=2, sequence_parallel=True, zero1=True)),
}
ALL_JOBS = {**TWO_RANK_JOBS, **FOUR_RANK_JOBS}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(H.run_suite, 2, args=(TWO_RANK_JOBS, ("vocab_ce", "topology")))


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(H.run_suite, 4, args=(FOUR_RANK_JOBS, ("topology",)))


@functools.cache
def reference(arch: str, overrides: tuple) -> dict:
    torch.set_num_threads(1)
    return H.train_job(arch, dict(overrides), H.Layout())


def _results(name, two_ranks_results, four_ranks_results):
    return (two_ranks_results if name in TWO_RANK_JOBS else four_ranks_results)


@pytest.fixture
def results(request):
    name = request.param
    ranks = request.getfixturevalue("two_ranks" if name in TWO_RANK_JOBS else "four_ranks")
    arch, overrides, _ = ALL_JOBS[name]
    return [r[name] for r in ranks], reference(arch, tuple(sorted(overrides.items())))


@pytest.mark.parametrize("results", list(ALL_JOBS), indirect=True)
@pytest.mark.long("its module fixture trains every layout under gloo once, shared by all the module's tests")
def test_losses_match_single_process(results):
    ranks, ref = results
    for rank in ranks:
        assert rank["losses"] == ranks[0]["losses"], "every rank reports the same loss"
        H.assert_trains_as_reference(rank, ref)
        # With a capacity factor, the same (token, slot) assignments are dropped, counted over the global batch.
        assert rank["dropped"] == ref["dropped"]
    H.assert_learns(ref)


@pytest.mark.parametrize("results", list(ALL_JOBS), indirect=True)
def test_parameters_match_single_process(results):
    ranks, ref = results
    for rank in ranks[1:]:
        for name, value in rank["state"].items():
            # Replicas (DP copies, TP-replicated norms and biases, shared KV heads) must not drift apart at all.
            assert torch.equal(value, ranks[0]["state"][name]), f"{name} differs between ranks"
    for rank in ranks:
        assert rank["state"].keys() == ref["state"].keys()
        for name, expected in ref["state"].items():
            torch.testing.assert_close(rank["state"][name], expected, rtol=1e-5, atol=1e-5, msg=name)


def test_vocab_parallel_cross_entropy_equals_cross_entropy(two_ranks):
    logits, labels, upstream = H.cross_entropy_inputs()
    full = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    (expected * upstream).sum().backward()
    shards = sorted((r["vocab_ce"] for r in two_ranks), key=lambda r: r["tp_rank"])
    for shard in shards:
        torch.testing.assert_close(shard["loss"], expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([s["grad"] for s in shards], dim=-1), full.grad, rtol=1e-6, atol=1e-7)


def test_vocab_parallel_cross_entropy_leaves_out_the_padded_vocabulary(two_ranks):
    """With padding_from, the loss is F.cross_entropy over the real entries alone, and the padded entries' gradient
    is exactly zero."""
    logits, labels, upstream = H.cross_entropy_inputs()
    real = logits[..., :H.PADDING_FROM].clone().requires_grad_(True)
    expected = F.cross_entropy(real.flatten(0, 1), (labels % H.PADDING_FROM).flatten(), reduction="none")
    (expected.view(labels.shape) * upstream).sum().backward()
    shards = sorted((r["vocab_ce"] for r in two_ranks), key=lambda r: r["tp_rank"])
    for shard in shards:
        torch.testing.assert_close(shard["padded_loss"], expected.detach().view(labels.shape), rtol=1e-6, atol=1e-6)
    grad = torch.cat([s["padded_grad"] for s in shards], dim=-1)
    torch.testing.assert_close(grad[..., :H.PADDING_FROM], real.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(grad[..., H.PADDING_FROM:], torch.zeros_like(grad[..., H.PADDING_FROM:]))


@pytest.mark.parametrize("world", [2, 4])
def test_topology_groups_sum_over_the_computed_ranks(world, two_ranks, four_ranks):
    ranks = two_ranks if world == 2 else four_ranks
    for r in ranks:
        check = r["topology"]
        for axis, members in check["groups"].items():
            assert members == check["ranks"][axis], (axis, check)
            assert check["rank"] in members
        # tp fastest: a TP group is consecutive ranks.
        tp = check["groups"]["tp"]
        assert tp == list(range(tp[0], tp[0] + 2))
