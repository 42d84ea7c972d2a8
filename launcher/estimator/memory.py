# Memory per device for a training config, as pure arithmetic over the model shape and the parallel layout.
#
# The accounting follows what runtime/ actually holds, so it can be checked against a measurement on CPU:
#   weights      param dtype (fp32, or bf16 for bf16SR / mixed_precision*), every parameter of this device's stage;
#                under ZeRO-3 the rank's 1/S shard of them plus two gathered units (the one computing and the one
#                prefetched: 2 x the largest unit, shapes.largest_unit_parameters), LoRA's frozen bases whole
#   gradients    fp32 always: data parallelism accumulates micro-batch gradients in an fp32 buffer; under ZeRO-2/3
#                the rank's 1/S shard of them when a step is one micro-batch (the full buffers then exist only
#                through backward, bucket by bucket: not counted). With gradient accumulation the full buffers
#                stay from the first micro-batch's backward to the last one's reduce-scatter (runtime/parallel/
#                data_parallel.py, Megatron's choice: ZeRO-1's sums bit for bit), so they are counted whole.
#   optimizer    Adam's two fp32 moments (+ fp32 master weights under mixed_precision*), divided by S under ZeRO-1/2/3
# S is the shard group: all of dp, or model.data_parallel_shard_degree ranks of it (hybrid sharding: the state
# sharded within each group, replicated across the dp / S groups); the experts' over their expert-data-parallel
# ranks inside the group (Layout.shard, Layout.expert_shard). One shard group (S = 1) holds what ZeRO-0 does.
#   activations  what autograd keeps per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing
#                Activation Recomputation in Large Transformer Models"), times the micro-batches in flight
#   logits/loss  the output layer's (b, s, V/tp) logits and the cross entropy's fp32 working set, on the last stage
#
# Per-layer activations, in elements of E = micro_batch x seq x hidden (the paper's 34·sbh bytes is the fp16 case
# with dropout masks): two norm inputs, the QKV and MLP-in matmul inputs, Q/K/V, the attention output and the
# projection input, and the MLP intermediates (GELU: 2 x ffn, SwiGLU: 4 x ffn); with per-head q/k norms (Qwen3)
# their fp32 copies of q and k (qk_norm_bytes). Flash attention (what SDPA uses on GPU and CPU without attention
# dropout, and NxD Training's NKI kernel) stores no s x s matrix, only the output and its log-sum-exp; the unfused
# path stores softmax output, dropout mask and dropout output: (2c + 1)·a·s²·b bytes.
# Sequence parallelism divides the norm/dropout regions by tp. Where this runtime differs from Megatron it is
# counted as the runtime does it: a column-parallel linear under sequence parallelism saves its all-gathered
# (full-sequence) input rather than the shard, and an RMSNorm saves the fp32 copy it normalizes.
# Recompute: `selective` drops what core attention (and the MLP, if listed) would keep; `full` keeps only each
# layer's input and rebuilds one layer at a time in backward.
#
# MoE layers: weights and gradients hold the device's share of the experts, num_experts / ep of them and a tp-th
# of each (runtime/parallel/experts.py), and the replicated router; ZeRO-1 shards the experts' optimizer state over
# the expert-data-parallel group (dp / ep ranks: the others hold other experts) and the rest over dp. Activations
# hold only what a token's top_k experts and the router keep (see moe_activation_bytes).
#
# Long context (runtime/parallel/context.py, ring_attention.py): every activation term above counts the rank's own
# tokens, seq / context of each sample (cp for ring attention, u for Ulysses), so activations, logits and the
# backward working set divide by the context size; sequence parallelism then splits those tokens by tp as before.
# Ring attention is flash-style (no s x s matrix) and keeps q, k and v as it gets them (k, v not expanded to the
# query heads; v's view keeps the QKV output), the output and its log-sum-exp; its backward holds K/V blocks and
# their fp32 dK/dV accumulators in flight (ring_buffer_bytes). Ulysses' core attention keeps seq x heads / (tp·u)
# tensors, the same element count as seq / u x heads / tp: the all-to-all'd q, k, v (KV heads at one per query
# head) and its output, which the projection does not share (it gets the output back in sequence order); only an
# unfused score matrix (b, heads / (tp·u), s, s) divides by u once.
from __future__ import annotations

import math

import dataclasses

from launcher.estimator.shapes import (Layout, ModelShape, kv_heads_per_rank, largest_unit_parameters,
                                       layer_parameters, rank_layers, stage_expert_parameters, stage_moe_layers,
                                       stage_parameters, stage_rank)
from runtime.schema.sizes import arithmetic_of
from runtime.schema.facts import DTYPE_BYTES, OPTIMIZER_STATE_BYTES, PRECISION_POLICIES, PrecisionPolicy


@dataclasses.dataclass(frozen=True)
class PrecisionBytes:
    param: int          # weights as the model holds them
    master: int         # the optimizer's fp32 copy of the weights (0: the weights are their own master)
    compute: int        # matmul inputs and outputs
    residual: int       # the residual stream and norm inputs (the param dtype)
    weight_copies: bool  # autocast keeps a bf16 copy of every weight it multiplies until backward


def _precision_bytes(policy: PrecisionPolicy) -> PrecisionBytes:
    """The runtime's precision policy (runtime/schema/facts.py) in bytes."""
    return PrecisionBytes(param=DTYPE_BYTES[policy.param],
                          master=DTYPE_BYTES["fp32"] if policy.master_weights else 0,
                          compute=DTYPE_BYTES[policy.compute], residual=DTYPE_BYTES[policy.param],
                          weight_copies=policy.autocast is not None)


PRECISION_BYTES = {name: _precision_bytes(policy) for name, policy in PRECISION_POLICIES.items()}
GRAD_BYTES = DTYPE_BYTES["fp32"]         # fp32 gradient buffer (the main gradients)
# Optimizer state per parameter: the default optimizer's (AdamW: exp_avg + exp_avg_sq, fp32); each optimizer's own
# figure is runtime/schema/facts.py OPTIMIZER_STATE_BYTES, which the runtime's optimizers keep.
MOMENT_BYTES = OPTIMIZER_STATE_BYTES["adamw"]


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of one pipeline stage at its peak (the start of the first micro-batch's backward)."""
    stage: str
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    buffers: float               # RoPE tables
    activations: float           # saved for backward, all micro-batches in flight
    logits: float                # output layer + loss working set (last stage), at the start of backward
    backward: float              # one layer's backward: its gradients, and under full recompute its activations
    in_flight: float             # micro-batches whose activations this stage holds at once
    expert_parameters: int = 0   # of `parameters`, the experts' (ZeRO-1 shards their state over dp / ep ranks)
    gathered: float = 0.0        # of `weights`, ZeRO-3's gathered units in flight (two of the largest)
    full_weights: float = 0.0    # every parameter of the stage at the param dtype (ZeRO-3 holds `weights` of it)

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        # The loss's working set is gone by the time backward reaches the last layer.
        return self.static + self.activations + max(self.logits, self.backward)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What the accelerator's kernels keep, where that differs: SDPA uses a fused (flash) kernel that stores no
    s x s matrix except on CPU with attention dropout (the math path); dropout keeps a 1-byte mask on GPU and XLA
    (native_dropout) but a noise tensor of the activation dtype on CPU."""
    flash: bool = True
    mask_as_activation: bool = False

    @classmethod
    def for_accelerator(cls, shape: ModelShape, accelerator: str) -> "Kernels":
        on_cpu = accelerator == "cpu"
        return cls(flash=not (on_cpu and shape.attention_dropout > 0), mask_as_activation=on_cpu)


def in_flight_micro_batches(layout: Layout) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak. 1F1B: min(pp, micro-batches);
    the interleaved schedule holds (1 + (pp - 1) / (pp * vpp)) times more (Korthikanti et al., section 4.2.3)."""
    if layout.pp == 1:
        return 1.0
    held = float(min(layout.pp, layout.num_micro_batches))
    if layout.vpp > 1:
        held *= 1.0 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return held


def layer_activation_bytes(shape: ModelShape, layout: Layout, kernels: Kernels = Kernels(), *,
                           moe: bool = False) -> float:
    """Bytes autograd keeps for one transformer layer and one micro-batch on one device; `moe`: a layer whose MLP
    is shape.moe's block."""
    recompute = layout.recompute
    bytes_ = PRECISION_BYTES[layout.precision]
    c, r = bytes_.compute, bytes_.residual
    b, h, t = layout.micro_batch_size, shape.hidden_size, layout.tp
    s = layout.tokens_per_sample(shape.seq_length)  # the rank's tokens of each sample (all of them: context 1)
    E = b * s * h
    shard = 1.0 / t if layout.sequence_parallel else 1.0
    if recompute == "full":
        return r * E * shard  # the layer's input; everything else is rebuilt in backward

    selective = recompute == "selective"
    attn_recomputed = selective and "core_attention" in layout.recompute_modules
    mlp_recomputed = selective and "mlp" in layout.recompute_modules
    norm_input = _norm_bytes(shape, r)
    mask = c if kernels.mask_as_activation else 1
    heads = shape.num_attention_heads // t
    total = shape.norms_per_layer * norm_input * E * shard  # attention and MLP norm inputs (sandwich: and outputs)
    total += c * E                             # QKV input (gathered under SP: the runtime saves the full copy)
    family = arithmetic_of(shape)
    if family is not None:                     # an attention of the family's own (runtime/schema/sizes.py)
        total += family.activation_bytes(shape, b * s, t, c, core_kept=not attn_recomputed,
                                         scores=core_score_bytes(shape, layout, kernels, heads))
    else:
        total += _attention_bytes(shape, layout, kernels, attn_recomputed=attn_recomputed)
    ffn = shape.ffn_hidden_size // t
    if mlp_recomputed:
        total += r * E * shard                 # the recomputed MLP's input
    elif moe:
        total += c * E + moe_activation_bytes(shape, layout)  # the block's input (router and experts read it)
    else:
        total += c * E + c * b * s * ffn * (4 if shape.gated_mlp else 2)
    if shape.hidden_dropout > 0:
        total += 2 * mask * E * shard          # two dropout masks
    if bytes_.weight_copies:
        total += c * layer_parameters(shape, t, moe=moe, ep=layout.ep)
    if shape.num_query_groups % t:             # KV heads replicated: the concatenated QKV weight is saved per call
        total += (c if bytes_.weight_copies else bytes_.param) * (heads + 2) * shape.head_dim * h
    return total


def core_score_bytes(shape: ModelShape, layout: Layout, kernels: Kernels, heads: int) -> float:
    """What core attention itself keeps per micro-batch for `heads` heads on the rank, besides q, k, v and its
    output: a fused kernel its log-sum-exp; the unfused path its softmax (+ dropout mask and output), each query
    row against every key of the sequence (a sliding window masks keys of that full matrix, it does not shrink it);
    with attention sinks (CoreAttention._with_sinks, spelled out whatever the device) the softmax over the keys and
    the sink column, at softmax's dtype (fp32 under autocast, which then keeps the bf16 copy P.V reads), and the
    boolean mask."""
    bytes_ = PRECISION_BYTES[layout.precision]
    c, b = bytes_.compute, layout.micro_batch_size
    s, seq = layout.tokens_per_sample(shape.seq_length), shape.seq_length
    if shape.network.attention_sinks:
        softmax = 4 if bytes_.weight_copies else c
        return b * heads * s * ((seq + 1) * softmax + (c * seq if softmax != c else 0)) + s * seq
    if kernels.flash or layout.cp > 1:        # ring attention is flash-style whatever the device
        return 4 * b * heads * s               # log-sum-exp
    # Softmax (+ mask, dropout): each of the rank's query rows against every key. Under Ulysses that is
    # (b, heads / (tp·u), seq, seq), the same count as (b, heads / tp, seq / u, seq).
    mask = c if kernels.mask_as_activation else 1
    dropout = mask + c if shape.attention_dropout > 0 else 0
    return (c + dropout) * b * heads * s * seq


def _attention_bytes(shape: ModelShape, layout: Layout, kernels: Kernels, *, attn_recomputed: bool) -> float:
    """Grouped-query attention's saved tensors past its input, for one micro-batch on one rank: q, k, v as core
    attention gets them (or the QKV output they are views of), per-head q/k norms, the attention output, and what
    core attention keeps (core_score_bytes) unless it is recomputed."""
    c = PRECISION_BYTES[layout.precision].compute
    b, t = layout.micro_batch_size, layout.tp
    s = layout.tokens_per_sample(shape.seq_length)
    heads, kv = shape.num_attention_heads // t, kv_heads_per_rank(shape, t)

    def width(columns: float) -> float:        # a (b, s, columns * head_dim) tensor
        return c * b * s * columns * shape.head_dim

    total = 0.0
    qkv = heads + 2 * kv
    # Whether autograd keeps the QKV output itself, through views of it (q, k, v; only v where q, k are rotated).
    qkv_output_kept = (not shape.network.rotary or attn_recomputed or layout.cp > 1
                       or (kv == heads and layout.ulysses == 1))
    if not shape.network.rotary:
        total += width(qkv)                    # q, k, v are views of the QKV output
    elif qkv_output_kept:
        total += width(heads + kv) + width(qkv)  # rotated q, k; the QKV output lives on through v's view
    else:
        total += width(3 * heads)              # rotated q, and k, v repeated to every query head (GQA; Ulysses)
    if shape.qk_layernorm:
        total += qk_norm_bytes(shape, layout, qkv_output_kept=qkv_output_kept)
    # The attention output, which the projection saves as its input: fused kernels return it in (b, s, heads, d)
    # memory order, so the reshape back to (b, s, h) is a view of what the kernel itself keeps for backward.
    # Ulysses' kernel keeps its head-split output, and the projection gets a sequence-ordered copy.
    total += width(heads) * (2 if layout.ulysses > 1 and not attn_recomputed else 1)
    if not attn_recomputed:
        if not (kernels.flash or layout.cp > 1 or shape.network.attention_sinks):
            total += width(2 * heads)          # the math path's scaled q and k
        total += core_score_bytes(shape, layout, kernels, heads)
    return total


def qk_norm_bytes(shape: ModelShape, layout: Layout, *, qkv_output_kept: bool) -> float:
    """What the per-head RMSNorms over the rank's query and key heads keep for one micro-batch (Qwen3's q_norm and
    k_norm; they run before core attention, so its recompute keeps them too), as autograd's saved tensors show it:
    the fp32 normalized tensor, a 1 / rms per head and token, and the fp32 input. In bf16 that input is an upcast
    copy; in fp32 it is the QKV output itself (q and k are views of it), which the norms then keep alive where
    nothing else did (`qkv_output_kept` False: GQA, whose core attention keeps repeated copies of k and v)."""
    c = PRECISION_BYTES[layout.precision].compute
    b, s, d = layout.micro_batch_size, layout.tokens_per_sample(shape.seq_length), shape.head_dim
    heads, kv = shape.num_attention_heads // layout.tp, kv_heads_per_rank(shape, layout.tp)
    rows = b * s * (heads + kv)                # one per query or key head and token
    total = 4 * rows * d + 4 * rows            # normalized, 1 / rms
    if c != 4:
        total += 4 * rows * d                  # the upcast input
    elif not qkv_output_kept:
        total += c * b * s * (heads + 2 * kv) * d  # the QKV output
    return total


def moe_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """What runtime/models/moe.py keeps for backward beyond the block's input, per micro-batch (as autograd's saved
    tensors show it). For each row of the experts' padded batches: its copy of the token (the gate_up matmul's
    input) and the SwiGLU intermediates as in a dense MLP (gate_up output 2f, silu output f, product f, with f the
    expert's size; a tp-th of each under tensor parallelism). For each of the b·s·top_k (token, expert) assignments:
    the expert's output row gathered for the routing weight's multiply and the weighted row index_add keeps (h
    each), and the bookkeeping (five int64 indices, two fp32 weights, a keep flag). Per token: the router's fp32
    probabilities (softmax keeps them; with the z-loss also its fp32 logits) and their top_k sum. Tokens are the
    whole micro-batch: under sequence parallelism the block gathers the sequence first. Shared experts
    (moe.shared_ffn_hidden_size) keep a dense SwiGLU's intermediates for every token.

    With a capacity factor the batches are fixed: num_experts x capacity rows (capacity_factor x the assignments),
    whatever the routing. Dropless they are padded to the busiest expert's count: this takes routing as balanced
    (one row per assignment), and an uneven router costs more. Expert parallelism changes no count: a rank runs
    num_experts / ep experts on ep ranks' batches."""
    c = PRECISION_BYTES[layout.precision].compute
    moe, h, f = shape.moe, shape.hidden_size, shape.expert_ffn_hidden_size // layout.tp
    tokens = layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length)
    assignments = tokens * moe.top_k
    rows = assignments
    if moe.capacity_factor is not None:
        rows = moe.num_experts * math.ceil(moe.capacity_factor * assignments / moe.num_experts)
    router = 4 * moe.num_experts * (2 if moe.router_z_loss_coef else 1) + 4
    shared = c * 4 * shape.shared_ffn_hidden_size  # the shared experts' SwiGLU, whole on every tensor-parallel rank
    return (rows * c * (h + 4 * f) + assignments * (c * 2 * h + 5 * 8 + 2 * 4 + 1)
            + tokens * (router + shared))


def _norm_bytes(shape: ModelShape, residual: int) -> int:
    """Bytes a norm keeps per element: LayerNorm its input; the runtime's RMSNorm runs in fp32 on an upcast copy
    and keeps that copy and the normalized fp32 tensor (for the weight's gradient)."""
    return 8 if shape.rms_norm else residual


def backward_working_bytes(shape: ModelShape, layout: Layout, *, moe: bool = False) -> float:
    """Gradients alive while backward runs through one layer: the residual stream's and two MLP-wide ones (of an
    MoE layer, two as wide as the top_k experts' intermediates together); with ring attention also the K/V blocks
    in flight (ring_buffer_bytes); with attention sinks the gradient of the spelled-out scores (as wide as what
    core_score_bytes counts for them)."""
    c = PRECISION_BYTES[layout.precision].compute
    b, s = layout.micro_batch_size, layout.tokens_per_sample(shape.seq_length)
    scores = 0.0
    if shape.network.attention_sinks:
        scores = core_score_bytes(shape, layout, Kernels(), shape.num_attention_heads // layout.tp)
    if moe:
        return scores + c * b * s * (shape.hidden_size
                                     + 2 * shape.moe.top_k * (shape.expert_ffn_hidden_size // layout.tp))
    return (scores + c * b * s * (shape.hidden_size + 2 * shape.ffn_hidden_size // layout.tp)
            + ring_buffer_bytes(shape, layout))


def kv_block_bytes(shape: ModelShape, layout: Layout, *, dtype_bytes: int | None = None) -> float:
    """One rank's K and V for one micro-batch, as the ring passes them: 2 x (b, seq / cp, kv_heads / tp, head_dim)
    at the compute dtype (a replicated KV head per rank when tp exceeds the KV heads); `dtype_bytes` 4: their
    dK/dV, which the ring accumulates in fp32."""
    c = dtype_bytes or PRECISION_BYTES[layout.precision].compute
    tokens = layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length)
    return 2 * c * tokens * kv_heads_per_rank(shape, layout.tp) * shape.head_dim


def ring_buffer_bytes(shape: ModelShape, layout: Layout) -> float:
    """Ring attention's backward, per rank: the K/V block in hand and the one arriving, the fp32 dK/dV accumulator
    in hand and the one arriving, the fp32 dq accumulator (b, heads / tp, seq / cp, head_dim), and with GQA the
    block's K and V repeated to every query head. Nothing without context parallelism."""
    if layout.cp <= 1:
        return 0.0
    c = PRECISION_BYTES[layout.precision].compute
    tokens = layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length)
    heads, kv = shape.num_attention_heads // layout.tp, kv_heads_per_rank(shape, layout.tp)
    expanded = 2 * c * tokens * heads * shape.head_dim if kv != heads else 0.0
    return (2 * kv_block_bytes(shape, layout) + 2 * kv_block_bytes(shape, layout, dtype_bytes=4)
            + 4 * tokens * heads * shape.head_dim + expanded)


def loss_bytes(shape: ModelShape, layout: Layout) -> float:
    """The last stage's output layer and loss for one micro-batch at their peak: the final norm's and the output
    layer's saved inputs, the (b, s, V/tp) logits, and the loss's fp32 buffer. The runtime's cross entropy works in
    place (the logits become exp(z - max) in forward and the gradient in backward), so bf16 logits cost their
    own 2 bytes plus the 4-byte fp32 copy, and fp32 logits 4 bytes, per token and vocabulary entry. The output
    layer's backward then holds the logits' gradient with its own weight gradient."""
    bytes_ = PRECISION_BYTES[layout.precision]
    c, r = bytes_.compute, bytes_.residual
    b, s, t = layout.micro_batch_size, layout.tokens_per_sample(shape.seq_length), layout.tp
    E = b * s * shape.hidden_size
    shard = 1.0 / t if layout.sequence_parallel else 1.0
    tokens_by_vocab = b * s * shape.vocab_size / t
    loss = tokens_by_vocab * (c + (4 if c != 4 else 0))
    output_weights = shape.vocab_size / t * shape.hidden_size
    output_backward = tokens_by_vocab * c + bytes_.param * output_weights + c * E
    copies = c * output_weights if bytes_.weight_copies else 0.0  # autocast's bf16 copy of the output weight
    return _norm_bytes(shape, r) * E * shard + c * E + copies + max(loss, output_backward)


def stage_memory(shape: ModelShape, layout: Layout, *, first: bool, last: bool,
                 kernels: Kernels = Kernels(), rank: int | None = None) -> StageMemory:
    """rank: a middle pipeline rank (first and last False), which model.pipeline_cuts can make the largest."""
    bytes_ = PRECISION_BYTES[layout.precision]
    params = stage_parameters(shape, layout, first=first, last=last, rank=rank)
    experts = stage_expert_parameters(shape, layout, first=first, rank=rank)
    layers = len(rank_layers(shape, layout, stage_rank(layout, first, rank)))
    buffers = 0.0
    # fp32 cos and sin tables: one RoPE module serves every layer of the model (runtime/families/llama/model.py; a
    # family may have one per layer type), so a device holds rotary_tables pairs whatever its number of layers.
    buffers += shape.rotary_tables * shape.max_position_embeddings * shape.rotary_dim * 2 * 4
    if first or last or rank is None:
        in_flight = in_flight_micro_batches(layout) if first else 1.0
    else:  # 1F1B: rank r holds pp - r micro-batches at its peak (the interleaved schedule's factor on top)
        in_flight = in_flight_micro_batches(layout) * min(layout.pp - rank, layout.num_micro_batches) / \
            min(layout.pp, layout.num_micro_batches)
    moe_layers = stage_moe_layers(shape, layout, first=first, rank=rank)
    activations = (layers - moe_layers) * in_flight * layer_activation_bytes(shape, layout, kernels)
    if moe_layers:
        activations += moe_layers * in_flight * layer_activation_bytes(shape, layout, kernels, moe=True)
    if first and shape.hidden_dropout > 0 and shape.network.embedding_dropout:  # the embedding's dropout mask
        mask = bytes_.compute if kernels.mask_as_activation else 1
        activations += (in_flight * mask * layout.micro_batch_size * layout.tokens_per_sample(shape.seq_length)
                        * shape.hidden_size)
    # The largest of the stage's layer kinds (dense, MoE): backward runs through one layer at a time.
    kinds = [moe for moe, count in ((False, layers - moe_layers), (True, moe_layers)) if count] or [False]
    rebuilt = dataclasses.replace(layout, recompute=None)
    backward = max(backward_working_bytes(shape, layout, moe=moe)
                   + (layer_activation_bytes(shape, rebuilt, kernels, moe=moe) if layout.recompute == "full" else 0)
                   for moe in kinds)
    name = "only" if first and last else "first" if first else "last" if last else f"rank {rank}"
    unit = largest_unit_parameters(shape, layout, first=first, last=last, rank=rank)
    return StageMemory(
        stage=name,
        parameters=params,
        **sharded_state(layout, params, experts, unit),
        buffers=buffers,
        activations=activations,
        logits=loss_bytes(shape, layout) if last else 0.0,
        backward=backward,
        in_flight=in_flight,
        expert_parameters=experts,
    )


def sharded_state(layout: Layout, params: int, experts: int, unit: int) -> dict[str, float]:
    """Weights, gradients and optimizer state of a device holding `params` parameters (`experts` of them the
    experts') at the layout's ZeRO stage: stage >= 1 divides the optimizer state by the shard group (S: dp, or
    model.data_parallel_shard_degree), >= 2 the gradients too (one micro-batch a step: accumulation keeps them whole,
    see the header), 3 the weights too, plus two gathered units of `unit` parameters each (the one computing and the
    next, prefetched). Experts' state divides by their own shard group."""
    bytes_ = PRECISION_BYTES[layout.precision]
    stage = layout.parallel.stage  # model.zero_stage, or zero1 as stage 1
    grads_from = 2 if layout.num_micro_batches <= 1 else 4  # 4: no stage shards accumulating gradients

    def per_rank(at_stage: int) -> float:  # parameters' worth this rank holds of a term sharded from `at_stage` on
        if stage < at_stage:
            return float(params)
        return (params - experts) / layout.shard + experts / layout.expert_shard

    gathered = 2.0 * unit * bytes_.param if stage == 3 and max(layout.shard, layout.expert_shard) > 1 else 0.0
    return {"weights": per_rank(3) * bytes_.param + gathered, "gradients": GRAD_BYTES * per_rank(grads_from),
            "optimizer": (MOMENT_BYTES + bytes_.master) * per_rank(1), "gathered": gathered,
            "full_weights": float(params * bytes_.param)}


def frozen_weights(stage: StageMemory) -> StageMemory:
    """A stage under LoRA (model.peft): the frozen weights keep no gradients and no optimizer state, and stay whole
    under ZeRO-3 (they have no bucket to shard); the adapters' (rank x (in + out) per adapted projection, a few MiB)
    are left out."""
    return dataclasses.replace(stage, weights=stage.full_weights, gathered=0.0, gradients=0.0, optimizer=0.0)


def pipeline_stages(shape: ModelShape, layout: Layout, kernels: Kernels = Kernels(), *,
                    lora: bool = False) -> list[StageMemory]:
    """Every pipeline stage that can be the largest: the first (most micro-batches in flight) and the last (logits);
    with model.pipeline_cuts a middle stage may hold more layers than either, so every rank."""
    if layout.pp == 1:
        stages = [stage_memory(shape, layout, first=True, last=True, kernels=kernels)]
    else:
        stages = [stage_memory(shape, layout, first=True, last=False, kernels=kernels),
                  stage_memory(shape, layout, first=False, last=True, kernels=kernels)]
        if layout.pipeline_cuts is not None:
            stages += [stage_memory(shape, layout, first=False, last=False, kernels=kernels, rank=r)
                       for r in range(1, layout.pp - 1)]
    return [frozen_weights(s) for s in stages] if lora else stages


def peak_memory(shape: ModelShape, layout: Layout, kernels: Kernels = Kernels(), *, lora: bool = False) -> StageMemory:
    """The device with the most memory, of every stage pipeline_stages names."""
    return max(pipeline_stages(shape, layout, kernels, lora=lora), key=lambda stage: stage.total)
