# FLOPs and time: model FLOPs per token (the runtime's MFU convention), the step time a layout should reach (used
# to rank autoconfig candidates), and the days a token budget takes at an assumed MFU. An MoE layer's FLOPs are
# what a token runs: its top_k experts and the router, not every expert (6·N with N the active weights). Expert
# parallelism adds the token exchanges (all-to-all) to the step and moves the experts' gradient reduction to the
# expert-data-parallel group. Long context adds the context group's exchanges (ring K/V passes, less what they
# overlap with attention, or Ulysses' all-to-alls) and leaves gradient reduction over every data-parallel rank; each
# rank's matrix multiplies, TP and PP messages act on its seq / context tokens. ZeRO-3 adds its parameter
# all-gathers (data_parallel_seconds), hybrid sharding an all-reduce of each shard across the replicas.
from __future__ import annotations

import math

import dataclasses

from launcher.estimator.hardware import Hardware
from launcher.estimator.memory import GRAD_BYTES, PRECISION_BYTES, kv_block_bytes
from launcher.estimator.shapes import (Layout, ModelShape, count_parameters, expert_parameters, kv_heads_per_rank,
                                       most_layers, stage_moe_layers)
from runtime.schema import sizes

SECONDS_PER_DAY = 86400.0


def matmul_weights(shape: ModelShape) -> int:
    """Weights that take part in a matrix multiply per token (runtime/schema/sizes.py matmul_weights): every
    layer's projections and MLP (of an MoE layer the token's top_k experts, the router and shared experts), and the
    output layer."""
    return sizes.matmul_weights(shape)


def flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token, forward + backward: sizes.flops_per_token, the formula the runtime's MFU uses."""
    return sizes.flops_per_token(shape)


def recompute_flops_per_token(shape: ModelShape, layout: Layout) -> float:
    """Extra forward FLOPs that activation recomputation spends per token (not counted in MFU)."""
    h = shape.hidden_size
    attention_forward = sizes.attention_flops_per_token(shape)  # QK^T and the weighted sum of V (sizes.py)
    if layout.recompute == "full":
        return (flops_per_token(shape) - 6.0 * h * shape.vocab_size) / 3.0  # one more forward of every layer
    if layout.recompute == "selective":
        extra = attention_forward if "core_attention" in layout.recompute_modules else 0.0
        if "mlp" in layout.recompute_modules:  # the MLP again (of an MoE block what a token runs)
            extra += 2.0 * sum(sizes.mlp_matmul_weights(shape, index) for index in range(shape.num_layers))
        return extra
    return 0.0


def training_flops(shape: ModelShape, tokens: float) -> float:
    return flops_per_token(shape) * tokens


def days_to_train(shape: ModelShape, tokens: float, devices: int, hardware: Hardware, mfu: float) -> float:
    """Wall-clock days for `tokens` at an assumed model-FLOPs utilization (recompute and bubbles included in it)."""
    return training_flops(shape, tokens) / (devices * hardware.peak_tflops * 1e12 * mfu) / SECONDS_PER_DAY


def six_n_t_parameters(budget_flops: float, tokens: float) -> float:
    """The Chinchilla-style 6·N·T rule, solved for N: the parameters a compute budget trains on `tokens`."""
    return budget_flops / (6.0 * tokens)


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float            # forward + backward (+ recompute) at the assumed efficiency
    bubble_s: float             # pipeline fill and drain
    tensor_parallel_s: float    # activations all-reduced (or gathered/scattered) inside each layer
    data_parallel_s: float      # gradient reduction (+ ZeRO-1/2's parameter all-gather, ZeRO-3's gathers)
    pipeline_s: float           # activations sent between stages
    model_flops: float          # per step, all devices
    expert_parallel_s: float = 0.0  # MoE tokens sent to their experts' ranks and back (all-to-all), ep > 1
    context_parallel_s: float = 0.0  # ring K/V passes (cp > 1) or Ulysses' all-to-alls (ulysses > 1)
    param_gather_s: float = 0.0  # of data_parallel_s, ZeRO-3's per-unit parameter all-gathers

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tensor_parallel_s + self.data_parallel_s + self.pipeline_s
                + self.expert_parallel_s + self.context_parallel_s)


def _ring_seconds(bytes_: float, ranks: int, gbps: float, *, all_reduce: bool) -> float:
    if ranks <= 1:
        return 0.0
    factor = 2.0 * (ranks - 1) / ranks if all_reduce else (ranks - 1) / ranks
    return factor * bytes_ / (gbps * 1e9)


def _all_to_all_seconds(bytes_: float, ranks: int, gbps: float) -> float:
    """An all-to-all of a `bytes_` buffer per rank: each rank keeps its own 1/ranks and sends the rest, so
    (ranks - 1) / ranks of it crosses the links, as in a ring all-gather or reduce-scatter of that size."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * bytes_ / (gbps * 1e9)


def all_to_all_bytes(shape: ModelShape, layout: Layout) -> float:
    """What one rank puts into one MoE layer's token exchange for one micro-batch, at the compute dtype. Tokens are
    the whole micro-batch, the same on every tensor-parallel rank (the block gathers the sequence under sequence
    parallelism). Dropless: the hidden vector of every (token, slot) assignment, top_k x micro_batch x seq x
    hidden values (routing taken as balanced), and each TP rank sends its own copy. With a capacity factor the
    runtime sends fixed-size batches, num_experts x capacity rows padding included (capacity_factor x the
    assignments, whatever the routing), and each TP rank carries only its 1/tp of the rows."""
    c = PRECISION_BYTES[layout.precision].compute
    moe = shape.moe
    assignments = moe.top_k * layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length)
    if moe.capacity_factor is None:
        return assignments * shape.hidden_size * c
    rows = math.ceil(math.ceil(moe.capacity_factor * assignments / moe.num_experts) / layout.tp)
    return moe.num_experts * rows * shape.hidden_size * c


def exchanges_per_moe_layer(layout: Layout) -> int:
    """All-to-alls per MoE layer and micro-batch: dispatch and combine in forward, their adjoints in backward, and
    forward's two again when recompute reruns the block (full, or selective with the MLP)."""
    rerun = layout.recompute == "full" or (layout.recompute == "selective" and "mlp" in layout.recompute_modules)
    return 4 + (2 if rerun else 0)


def expert_parallel_seconds(shape: ModelShape, layout: Layout, hardware: Hardware) -> float:
    """The step's token exchanges on one rank: micro-batches x the pipeline rank's MoE layers x exchanges, each an
    all-to-all over the expert-parallel group. That group is ep consecutive data-parallel ranks, tp * ep
    consecutive global ranks: inside a node when tp * ep fits in one, over the network otherwise."""
    if shape.moe is None or layout.ep <= 1:
        return 0.0
    moe_layers = max(stage_moe_layers(shape, layout, first=True), stage_moe_layers(shape, layout, first=False))
    gbps = hardware.inter_node_gbps if layout.tp * layout.ep > layout.devices_per_node else hardware.intra_node_gbps
    return (layout.num_micro_batches * moe_layers * exchanges_per_moe_layer(layout)
            * _all_to_all_seconds(all_to_all_bytes(shape, layout), layout.ep, gbps))


def attention_reruns(layout: Layout) -> bool:
    """Whether backward runs core attention's forward again (full recompute, or selective with core attention)."""
    return layout.recompute == "full" or (layout.recompute == "selective"
                                          and "core_attention" in layout.recompute_modules)


def ring_bytes_per_layer(shape: ModelShape, layout: Layout) -> float:
    """Bytes one rank sends to its ring neighbour per layer and micro-batch under context parallelism, with B its
    K/V block and G the block's dK/dV in fp32 (kv_block_bytes; G = 2B in bf16): forward passes B on cp - 1 times,
    so every rank sees every block; backward passes the blocks round again (cp - 1 times) and with them their
    accumulators (G, cp - 1 times), then the accumulators one last hop home (G):
    (cp - 1)·B + (cp - 1)·B + cp·G, and (cp - 1)·B more when attention's forward is rerun in backward."""
    cp = layout.cp
    if cp <= 1:
        return 0.0
    block, grads = kv_block_bytes(shape, layout), kv_block_bytes(shape, layout, dtype_bytes=4)
    forward = (cp - 1) * block
    return forward * (2 if attention_reruns(layout) else 1) + (cp - 1) * block + cp * grads


def ring_seconds_per_layer(shape: ModelShape, layout: Layout, gbps: float, flops_per_s: float) -> float:
    """Exposed seconds of one layer's ring passes for one micro-batch. The runtime starts each pass before a block's
    attention and waits for it after (runtime/parallel/ring_attention.py), so a pass costs only what its transfer
    takes beyond that block's compute: per step, the step's share of the attention FLOPs compute_s charges,
    4·b·(q/tp)·(seq/cp)² forward (q = heads x head_dim) and twice that backward. Forward: cp - 1 passes of B.
    Backward: B during the rank's own block, B + G during each of the next cp - 2, G during the last, and G home
    after it (exposed)."""
    cp = layout.cp
    if cp <= 1:
        return 0.0
    block = kv_block_bytes(shape, layout) / (gbps * 1e9)
    grads = kv_block_bytes(shape, layout, dtype_bytes=4) / (gbps * 1e9)
    tokens = layout.tokens_per_sample(shape.seq_length)
    forward_compute = 4.0 * layout.micro_batch_size * shape.query_size / layout.tp * tokens ** 2 / flops_per_s
    backward_compute = 2.0 * forward_compute
    forward = (cp - 1) * max(0.0, block - forward_compute)
    backward = (max(0.0, block - backward_compute) + (cp - 2) * max(0.0, block + grads - backward_compute)
                + max(0.0, grads - backward_compute) + grads)
    return forward * (2 if attention_reruns(layout) else 1) + backward


def ulysses_bytes_per_layer(shape: ModelShape, layout: Layout) -> float:
    """The buffers one rank puts into Ulysses' all-to-alls per layer and micro-batch: q, k, v before core
    attention (sequence split to head split) and the output after, each (b, seq / u, columns / tp); forward and
    backward alike, the forward's again when attention is rerun. KV heads that do not split over u per rank are
    replicated to every query head first, so k and v are then as wide as q."""
    u = layout.ulysses
    if u <= 1:
        return 0.0
    c = PRECISION_BYTES[layout.precision].compute
    heads = shape.num_attention_heads // layout.tp
    kv = kv_heads_per_rank(shape, layout.tp)
    kv = kv if kv % u == 0 else heads
    tokens = layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length)
    once = c * tokens * shape.head_dim * (heads + 2 * kv + heads)  # q, k, v, output
    return once * (3 if attention_reruns(layout) else 2)


def context_parallel_seconds(shape: ModelShape, layout: Layout, hardware: Hardware, mfu: float) -> float:
    """The step's context-group traffic on one rank: micro-batches x the pipeline rank's layers x one layer's. A
    context group is cp (or u) consecutive data-parallel ranks, tp x cp consecutive global ranks: inside a node when
    that fits in one, over the network otherwise. Ring passes overlap the block attention they carry keys for
    (ring_seconds_per_layer); Ulysses' all-to-alls block, each moving (u - 1) / u of its buffer."""
    if layout.context <= 1:
        return 0.0
    inter_node = layout.tp * layout.context > layout.devices_per_node
    gbps = hardware.inter_node_gbps if inter_node else hardware.intra_node_gbps
    layers = layout.num_micro_batches * most_layers(shape, layout)
    if layout.cp > 1:
        flops_per_s = hardware.peak_tflops * 1e12 * mfu * gemm_efficiency(shape, layout)
        return layers * ring_seconds_per_layer(shape, layout, gbps, flops_per_s)
    return layers * _all_to_all_seconds(ulysses_bytes_per_layer(shape, layout), layout.ulysses, gbps)


def gemm_efficiency(shape: ModelShape, layout: Layout) -> float:
    """A heuristic for how far small matrix multiplies fall short of peak: each device's GEMMs have
    micro_batch x seq / context rows and hidden / tp columns; at 2^20 elements they reach half of the assumed
    efficiency."""
    size = layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length) * shape.hidden_size / layout.tp
    return size / (size + 2**20 / 8)


def step_time(shape: ModelShape, layout: Layout, hardware: Hardware, mfu: float) -> StepTime:
    """What one optimizer step should take with this layout: a model for ranking layouts before measuring them.
    Communication is counted as exposed (the runtime does not overlap it with compute), except the ring's passes."""
    c = PRECISION_BYTES[layout.precision].compute
    tokens = layout.global_batch_size * shape.seq_length
    model_flops = flops_per_token(shape) * tokens
    device_flops = (model_flops + recompute_flops_per_token(shape, layout) * tokens) / layout.world_size
    compute = device_flops / (hardware.peak_tflops * 1e12 * mfu * gemm_efficiency(shape, layout))
    m, p, v = layout.num_micro_batches, layout.pp, layout.vpp
    bubble = compute * (p - 1) / (m * v) if p > 1 else 0.0

    micro_activation = layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length) * shape.hidden_size * c
    layers = most_layers(shape, layout)  # the slowest stage: the others wait for it
    collectives_per_layer = 4 + (2 if layout.recompute == "full" else 0)  # 2 forward, 2 backward, 2 recomputed
    tensor_parallel = m * layers * collectives_per_layer * _ring_seconds(
        micro_activation, layout.tp, hardware.intra_node_gbps, all_reduce=True)

    # Gradients are reduced over dp (context groups included: their ranks hold replicas too), except the experts':
    # their replicas are the dp / ep ranks holding the same experts (the expert-data-parallel group, which spans as
    # many nodes as dp: ranks tp * ep apart).
    # Per device, averaged over pipeline ranks: every weight is split over tp x pp, the experts also over ep.
    all_experts = shape.num_moe_layers * shape.moe.num_experts * expert_parameters(shape) if shape.moe else 0
    dense = (count_parameters(shape).total - all_experts) / (layout.tp * p)
    experts = all_experts / (layout.tp * layout.ep * p)
    groups = ((dense, layout.dp, layout.shard), (experts, layout.edp, layout.expert_shard))
    traffic = [data_parallel_seconds(params, ranks, shard, hardware, layout) for params, ranks, shard in groups]
    data_parallel, gathers = sum(t[0] for t in traffic), sum(t[1] for t in traffic)

    pipeline = 0.0
    if p > 1:
        stage_gbps = hardware.inter_node_gbps if layout.tp * layout.dp * p > layout.devices_per_node else \
            hardware.intra_node_gbps
        shard = layout.tp if layout.sequence_parallel else 1
        pipeline = 2 * m * v * micro_activation / shard / (stage_gbps * 1e9)
    return StepTime(compute, bubble, tensor_parallel, data_parallel, pipeline, model_flops,
                    expert_parallel_seconds(shape, layout, hardware),
                    context_parallel_seconds(shape, layout, hardware, mfu), gathers)


def data_parallel_seconds(params: float, ranks: int, shard: int, hardware: Hardware,
                          layout: Layout) -> tuple[float, float]:
    """(the step's data-parallel seconds for `params` parameters per device replicated over `ranks`, of them
    ZeRO-3's parameter gathers). ZeRO-0: the fp32 gradients all-reduced over `ranks`. ZeRO-1/2/3 with a shard group
    of `shard` ranks (all of them, or model.data_parallel_shard_degree: hybrid sharding): reduce-scattered in the
    group, then each rank's 1/shard all-reduced across the ranks / shard replicas holding the same shard; ZeRO-1/2
    then all-gather the updated weights in the group at the parameter dtype once; ZeRO-3 instead gathers every
    unit in forward and again in backward of every micro-batch (2 x micro-batches x the weights; activation
    recompute reuses backward's gather: runtime/parallel/zero3.py), counted as exposed like the rest although the
    next unit's gather is prefetched. A shard group is layout.shard consecutive data-parallel ranks (the experts'
    ones ep apart inside them), tp x that global ranks: inside a node while that fits one; the replicas and ZeRO-0's
    group span all of dp."""
    if ranks <= 1 or params <= 0:
        return 0.0, 0.0
    stage, param_bytes = layout.parallel.stage, PRECISION_BYTES[layout.precision].param

    def gbps(dp_ranks: int) -> float:  # a group spanning `dp_ranks` consecutive data-parallel ranks
        return hardware.inter_node_gbps if layout.tp * dp_ranks > layout.devices_per_node else \
            hardware.intra_node_gbps

    if stage == 0:
        return _ring_seconds(GRAD_BYTES * params, ranks, gbps(layout.dp), all_reduce=True), 0.0
    shard = max(1, min(shard, ranks))
    in_group = gbps(layout.shard)
    reduce = (_ring_seconds(GRAD_BYTES * params, shard, in_group, all_reduce=False)
              + _ring_seconds(GRAD_BYTES * params / shard, ranks // shard, gbps(layout.dp), all_reduce=True))
    gather = _ring_seconds(param_bytes * params, shard, in_group, all_reduce=False)
    if stage == 3:
        gathers = 2 * layout.num_micro_batches * gather
        return reduce + gathers, gathers
    return reduce + gather, 0.0
