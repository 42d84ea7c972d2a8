"""The estimator with long context: context parallelism (ring attention, model.context_parallel_size) and
DeepSpeed-Ulysses (model.ulysses_parallel_size), both carved out of data parallelism. Activations and the loss's
working set follow each rank's seq / context tokens; micro-batches follow the dp / context ranks that read distinct
samples; the ring's K/V passes (and what of them attention hides) and Ulysses' all-to-alls are counted by hand for a
tiny shape, as runtime/parallel/ring_attention.py and context.py do them."""

import dataclasses

import pytest

from launcher.estimator import estimate
from launcher.estimator.compute import (context_parallel_seconds, flops_per_token, gemm_efficiency,
                                        ring_bytes_per_layer, ring_seconds_per_layer, step_time,
                                        ulysses_bytes_per_layer)
from launcher.estimator.hardware import HARDWARE
from launcher.estimator.memory import (Kernels, backward_working_bytes, kv_block_bytes, layer_activation_bytes,
                                      loss_bytes, peak_memory, ring_buffer_bytes)
from launcher.estimator.shapes import Layout, ModelShape, padded_vocab
from tests.launcher.helpers import nxdt, resolved

LLAMA3_8B_32K = ModelShape("llama", 32, 4096, 14336, 32, 8, padded_vocab(128256, 128), 32768, 32768, False)
# hidden 64 = 4 heads of 16, 2 KV heads, ffn 256, 128 tokens: small enough to count every byte by hand.
TINY = ModelShape("llama", 2, 64, 256, 4, 2, 512, 128, 128, False)
H100 = HARDWARE["h100"]


def layout(**changes) -> Layout:
    base = Layout(num_nodes=4, devices_per_node=8, tp=1, pp=1, vpp=1, micro_batch_size=1, global_batch_size=64,
                  sequence_parallel=False, zero1=True, recompute=None, recompute_modules=(),
                  precision="mixed_precision")
    return dataclasses.replace(base, **changes)


def test_ring_layer_keeps_what_ring_attention_saves_by_hand():
    """TINY, bf16, tp 1, cp 2: 64 of the 128 tokens per rank, E = 64 x 64. Two RMSNorms' fp32 copies (8 bytes per
    element), the QKV input, the rotated q and k (4 + 2 heads of 16) and the QKV output that v's view keeps alive
    (8 heads; the ring saves k and v unrepeated), the output and its fp32 log-sum-exp, the MLP input and SwiGLU's
    4 x ffn intermediates. Without the split the GQA path keeps k, v repeated to the 4 query heads instead."""
    E = 64 * 64
    ring = 2 * 8 * E + 2 * E + 2 * 64 * 16 * (6 + 8) + 2 * 64 * 16 * 4 + 4 * 4 * 64 + 2 * E + 2 * 64 * 256 * 4
    assert layer_activation_bytes(TINY, layout(cp=2)) == ring == 250_880
    whole = 2 * 8 * 2 * E + 2 * 2 * E + 2 * 128 * 16 * 12 + 2 * 128 * 16 * 4 + 4 * 4 * 128 + 2 * 2 * E \
        + 2 * 128 * 256 * 4
    assert layer_activation_bytes(TINY, layout()) == whole == 493_568


@pytest.mark.parametrize("base", [
    layout(tp=8, sequence_parallel=True),
    layout(tp=2, sequence_parallel=True, recompute="selective", recompute_modules=("core_attention",)),
    layout(tp=4, recompute="full"),
])
def test_activations_and_loss_divide_by_the_context_size(base):
    """Every saved tensor holds the rank's seq / context tokens (flash attention: no s x s term), so a layer's
    activations halve with each doubling of cp or u; against no split they are within a few percent of 1 / size
    (the ring keeps k and v unrepeated, Ulysses its head-split output apart from the projection's copy). The output
    layer's working set is exactly 1 / size here (the cross entropy's (b, s / cp, V / tp) buffers dominate)."""
    whole = layer_activation_bytes(LLAMA3_8B_32K, base)
    for key in ("cp", "ulysses"):
        two = layer_activation_bytes(LLAMA3_8B_32K, dataclasses.replace(base, **{key: 2}))
        assert two == pytest.approx(whole / 2, rel=0.1)
        for size in (4, 8):
            assert layer_activation_bytes(LLAMA3_8B_32K, dataclasses.replace(base, **{key: size})) == \
                pytest.approx(two * 2 / size)
    for size in (2, 4, 8):
        assert loss_bytes(LLAMA3_8B_32K, dataclasses.replace(base, cp=size)) == \
            pytest.approx(loss_bytes(LLAMA3_8B_32K, base) / size)
    one, split = peak_memory(LLAMA3_8B_32K, base), peak_memory(LLAMA3_8B_32K, dataclasses.replace(base, cp=4))
    assert split.activations == pytest.approx(one.activations / 4, rel=0.1)
    # Weights, gradients and ZeRO-1's optimizer shards are the replica's: dp (all 32 / tp ranks) is unchanged.
    assert (split.weights, split.gradients, split.optimizer) == (one.weights, one.gradients, one.optimizer)


def test_unfused_attention_under_ulysses_divides_the_score_matrix_by_u_only():
    """The CPU math path with attention dropout keeps (b, heads / (tp·u), s, s) scores per rank: 1 / u of them,
    where every other term divides by u as well; ring attention never keeps them (it is flash-style)."""
    shape = dataclasses.replace(TINY, attention_dropout=0.1)
    unfused, flash = Kernels(flash=False, mask_as_activation=True), Kernels(flash=True, mask_as_activation=True)
    base = layout(precision="fp32")

    def extra(lay: Layout) -> float:  # what the math path keeps beyond the fused kernel's
        return layer_activation_bytes(shape, lay, unfused) - layer_activation_bytes(shape, lay, flash)

    # fp32, CPU: softmax output, dropout noise and dropout output (4 + 4 + 4 bytes) over (1, 4 heads, 128, 128);
    # the scaled q and k, (1, 128, 2 x 64); less the log-sum-exp the fused kernel keeps, (1, 4, 128).
    assert extra(base) == 12 * 4 * 128 * 128 + 4 * 128 * 2 * 64 - 4 * 4 * 128
    assert extra(dataclasses.replace(base, ulysses=2)) == extra(base) / 2
    ring = dataclasses.replace(base, cp=2)
    assert layer_activation_bytes(shape, ring, unfused) == layer_activation_bytes(shape, ring, flash)


def test_micro_batches_follow_the_ranks_that_read_distinct_samples():
    lay = layout(num_nodes=2, tp=2, global_batch_size=64)               # dp 8
    assert (lay.dp, lay.batch_dp, lay.num_micro_batches) == (8, 8, 8)
    ring = dataclasses.replace(lay, cp=4)
    assert (ring.dp, ring.context, ring.batch_dp, ring.num_micro_batches) == (8, 4, 2, 32)
    assert ring.tokens_per_sample(32768) == 8192
    # A step's tokens (and FLOPs) are the global batch's: each sample's tokens are split, not multiplied.
    per_step = flops_per_token(LLAMA3_8B_32K) * 64 * 32768
    assert step_time(LLAMA3_8B_32K, ring, H100, 0.4).model_flops == per_step
    assert step_time(LLAMA3_8B_32K, lay, H100, 0.4).model_flops == per_step


def test_ring_bytes_by_hand():
    """TINY, bf16, tp 1, cp 2: each rank's K/V block B is 2 (K, V) x 2 bytes x 64 tokens x 2 KV heads x 16 = 8 KiB,
    and its fp32 dK/dV G twice that. Forward passes B on once (cp - 1); backward passes B once more and G cp times
    (the last hop brings each block's gradients home): B + B + 2G = 48 KiB per layer and micro-batch, one more B
    when attention's forward is rerun."""
    lay = layout(cp=2)
    assert kv_block_bytes(TINY, lay) == 2 * 2 * 64 * 2 * 16 == 8192
    assert kv_block_bytes(TINY, lay, dtype_bytes=4) == 16384
    assert ring_bytes_per_layer(TINY, lay) == 8192 + 8192 + 2 * 16384
    assert ring_bytes_per_layer(TINY, dataclasses.replace(lay, recompute="full")) == 3 * 8192 + 2 * 16384
    # cp 4: blocks of 32 tokens, 3 passes of B each way and 4 of G.
    assert ring_bytes_per_layer(TINY, dataclasses.replace(lay, cp=4)) == 3 * 4096 + 3 * 4096 + 4 * 8192
    # tp 2 holds one KV head per rank: half the block.
    assert kv_block_bytes(TINY, dataclasses.replace(lay, tp=2)) == 4096
    # Backward holds two blocks and two fp32 accumulators, the fp32 dq (1, 4 heads, 64, 16) and, with GQA, a block
    # repeated to the 4 query heads.
    assert ring_buffer_bytes(TINY, lay) == 2 * 8192 + 2 * 16384 + 4 * 64 * 4 * 16 + 2 * 2 * 64 * 4 * 16
    assert backward_working_bytes(TINY, lay) - backward_working_bytes(TINY, layout()) / 2 == \
        ring_buffer_bytes(TINY, lay)


def test_ring_passes_hide_behind_the_attention_they_carry_keys_for():
    """At 1 GB/s B takes 8.192 us and G 16.384 us. A rate that makes one block's forward attention (4 x 1 x 64 x
    64² FLOPs) 4 us leaves 4.192 us of the forward pass exposed; backward (8 us per block) hides all but 0.192 us of
    B during the rank's own block and half of G during the other's, and the accumulators' hop home is exposed whole."""
    lay = layout(cp=2)
    flops = 4 * 1 * 64 * 64 ** 2
    exposed = ring_seconds_per_layer(TINY, lay, 1.0, flops / 4e-6)
    assert exposed == pytest.approx((8.192 - 4) * 1e-6 + (8.192 - 8) * 1e-6 + (16.384 - 8) * 1e-6 + 16.384e-6)
    # Nothing to hide behind: every byte at the link's rate. All hidden: only the last hop.
    assert ring_seconds_per_layer(TINY, lay, 1.0, 1e30) == pytest.approx(ring_bytes_per_layer(TINY, lay) / 1e9)
    assert ring_seconds_per_layer(TINY, lay, 1.0, 1.0) == pytest.approx(16384 / 1e9)
    # The step: micro-batches x layers x one layer's, over the node's links (tp x cp = 2 ranks fit in a node), at
    # the rate compute_s is charged.
    rate = H100.peak_tflops * 1e12 * 0.4 * gemm_efficiency(TINY, lay)
    assert lay.num_micro_batches == 64 // (32 // 2) == 4
    assert context_parallel_seconds(TINY, lay, H100, 0.4) == pytest.approx(
        4 * TINY.num_layers * ring_seconds_per_layer(TINY, lay, H100.intra_node_gbps, rate))


def test_ulysses_bytes_by_hand():
    """TINY, bf16, tp 1, u 2: q, k, v and the output go through all-to-alls in forward and backward, each
    (1, 64 tokens, columns x 16) at 2 bytes: q and output 4 heads, k and v 2 each (2 KV heads split over u 2)."""
    lay = layout(ulysses=2)
    once = 2 * 64 * 16 * (4 + 2 + 2 + 4)
    assert ulysses_bytes_per_layer(TINY, lay) == 2 * once
    # tp 2: one KV head per rank does not split over u 2, so k and v are replicated to the rank's 2 query heads.
    assert ulysses_bytes_per_layer(TINY, dataclasses.replace(lay, tp=2)) == 2 * (2 * 64 * 16 * (2 + 2 + 2 + 2))
    # Each all-to-all moves (u - 1) / u of its buffer, and nothing hides it.
    expected = lay.num_micro_batches * TINY.num_layers * 0.5 * 2 * once / (H100.intra_node_gbps * 1e9)
    assert context_parallel_seconds(TINY, lay, H100, 0.4) == pytest.approx(expected)


def test_context_traffic_only_with_a_context_group_and_gradients_still_over_all_of_dp():
    base = layout(num_nodes=2, tp=2, sequence_parallel=True)
    plain = step_time(LLAMA3_8B_32K, base, H100, 0.4)
    ring = step_time(LLAMA3_8B_32K, dataclasses.replace(base, cp=2), H100, 0.4)
    ulysses = step_time(LLAMA3_8B_32K, dataclasses.replace(base, ulysses=2), H100, 0.4)
    assert plain.context_parallel_s == 0 and ring.context_parallel_s > 0 and ulysses.context_parallel_s > 0
    assert ring.total_s == pytest.approx(sum((ring.compute_s, ring.bubble_s, ring.tensor_parallel_s,
                                              ring.data_parallel_s, ring.pipeline_s, ring.context_parallel_s)))
    # The replicas, and so the gradient reduction, are the same; per-layer TP traffic halves with the tokens, and
    # twice the micro-batches make the step's TP total the same.
    assert ring.data_parallel_s == plain.data_parallel_s
    assert ring.tensor_parallel_s == pytest.approx(plain.tensor_parallel_s)


def test_a_context_group_across_nodes_uses_the_network():
    for lay, gbps in ((layout(tp=4, cp=2), H100.intra_node_gbps),   # tp x cp = 8: one node
                      (layout(tp=4, cp=4), H100.inter_node_gbps)):  # 16: two nodes
        rate = H100.peak_tflops * 1e12 * 0.4 * gemm_efficiency(LLAMA3_8B_32K, lay)
        per_layer = ring_seconds_per_layer(LLAMA3_8B_32K, lay, gbps, rate)
        assert context_parallel_seconds(LLAMA3_8B_32K, lay, H100, 0.4) == pytest.approx(
            lay.num_micro_batches * LLAMA3_8B_32K.num_layers * per_layer)


def test_layout_is_read_from_the_training_config():
    training = resolved("training=llama3/8b_gpu", "training.model.context_parallel_size=2")["training"]
    result = estimate(training)
    assert (result.layout.cp, result.layout.ulysses, result.layout.context) == (2, 1, 2)
    training = resolved("training=llama3/8b_gpu", "training.model.ulysses_parallel_size=2")["training"]
    assert estimate(training).layout.ulysses == 2


def test_estimate_command_shows_the_context_group():
    result = nxdt("estimate", "training=llama3/8b_gpu", "training.model.context_parallel_size=2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "dp 64 · cp 2 (32 reading distinct samples) · micro-batch 1 × 64" in out
    assert "seq / 2" in out and "+ cp ring K/V" in out
    result = nxdt("estimate", "training=llama3/8b_gpu", "training.model.ulysses_parallel_size=2")
    assert result.returncode == 0, result.stderr
    assert "ulysses 2" in result.stdout and "+ ulysses all-to-all" in result.stdout
