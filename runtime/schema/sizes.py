# What a model is, in numbers: its shape (ModelShape), what one layer's attention holds and computes, and the model
# FLOPs per token, as pure arithmetic. The one formula the runtime's MFU (runtime/metrics.py) and the launcher's
# estimate (launcher/estimator: parameter counts, memory, time) both read. Torch-free, like all of runtime/schema.
#
# FLOPs per token (model FLOPs, the convention behind MFU in the PaLM and Megatron papers):
#     6 * N  +  6 * sum over layers of keys(layer) * heads * (qk_dim + v_dim)
# N counts the weights that take part in a matrix multiply per token: per layer the attention projections and the
# MLP (2*h*ffn, or 3*h*ffn gated), plus the output layer h*vocab; the input embedding is a lookup and is left out,
# as are biases, norms, attention sinks and the experts' selection bias. Each such weight costs 2 FLOPs per token
# forward and 4 backward, hence 6N. Of an MoE layer only what a token uses counts: its top_k experts (each of
# model.moe.ffn_hidden_size hidden units), the router (hidden x num_experts) and the shared experts every token goes
# through (model.moe.shared_ffn_hidden_size). The attention term: per layer and token, QK^T over qk_dim channels and
# the weighted sum of V over v_dim channels (both head_dim in plain attention, so 12 * q * T with q = heads *
# head_dim), against every key the layer attends to: the whole sequence (the full, non-causal count, as PaLM does),
# or on a sliding-window layer (model.layer_types) min(window, sequence) keys: the work that layer has to do.
# Recomputation under activation checkpointing is not counted: MFU measures useful work.
#
# Attention is the part a family may build its own way: its registry entry (runtime/schema/architecture.py) names a
# module (`arithmetic`) whose attention(shape, tp) -> AttentionSizes counts it (multi-head latent attention: the
# sizes.py of its family's folder); the plain grouped-query attention below takes the entry's switches
# (attention_biases, attention_sinks, qk_norm) and the model's keys (add_qkv_bias, qk_layernorm).
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from runtime.schema.architecture import Architecture
from runtime.schema.model import LatentAttention, MoEConfig


@dataclasses.dataclass(frozen=True)
class ModelShape:
    architecture: str            # a name in runtime/schema/families' ARCHITECTURES (`network`: what it is made of)
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int        # key/value heads (= num_attention_heads without GQA)
    vocab_size: int              # padded
    seq_length: int
    max_position_embeddings: int
    tied_embeddings: bool
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    moe: MoEConfig | None = None  # None: dense
    # The schema's model keys of the same names (runtime/schema/model.py ModelConfig).
    kv_channels: int | None = None    # the head size when it is not hidden / heads (Qwen3)
    add_qkv_bias: bool = False        # biases on q, k and v, none on the output projection (Qwen2)
    qk_layernorm: bool = False        # an RMSNorm (head_dim weights) over each query and key head (Qwen3)
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" layers see sliding_window keys
    sliding_window: int | None = None
    latent_attention: LatentAttention | None = None  # multi-head latent attention's ranks and head sizes

    @classmethod
    def of_model(cls, cfg: Any, seq_length: int) -> "ModelShape":
        """The shape of a runtime ModelConfig (runtime/schema/model.py) at `seq_length` tokens a sample."""
        return cls(cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
                   cfg.kv_heads, cfg.vocab_size, seq_length, cfg.max_position_embeddings,
                   cfg.share_embeddings_and_output_weights, cfg.hidden_dropout, cfg.attention_dropout, cfg.moe,
                   cfg.kv_channels, cfg.add_qkv_bias, cfg.qk_layernorm, cfg.layer_types, cfg.sliding_window,
                   cfg.latent_attention)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        """heads x head_dim: the width of the queries and of the attention output (the hidden size unless
        kv_channels sets the head size apart)."""
        return self.num_attention_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels RoPE's tables cover: a head's, or latent attention's qk_rope_head_dim."""
        return self.latent_attention.qk_rope_head_dim if self.latent_attention is not None else self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for index in range(self.num_layers) if self.is_moe_layer(index))

    def attention_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window, or None when it attends to the whole sequence (ModelConfig's rule)."""
        sliding = self.layer_types is not None and self.layer_types[index] == "sliding_attention"
        return self.sliding_window if sliding else None

    def keys_attended(self, index: int) -> int:
        """Keys each query of layer `index` is counted against: the sequence, or the window when smaller."""
        window = self.attention_window(index)
        return self.seq_length if window is None else min(window, self.seq_length)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's hidden units, as runtime/families/llama/model.py builds SparseMoE: moe.ffn_hidden_size, or
        the dense MLP's size when it is null (a dense model: the dense size)."""
        return self.ffn_hidden_size if self.moe is None else self.moe.expert_size(self.ffn_hidden_size)

    @property
    def shared_ffn_hidden_size(self) -> int:
        """The shared experts' hidden units in every MoE layer (moe.shared_ffn_hidden_size), 0 without them."""
        return (self.moe.shared_ffn_hidden_size or 0) if self.moe is not None else 0

    @property
    def network(self) -> Architecture:  # what the architecture is made of (runtime/schema/families' registry)
        from runtime.schema.families import architecture  # the registry imports the families, which import this

        return architecture(self.architecture)

    @property
    def gated_mlp(self) -> bool:      # SwiGLU: three matrices of h x ffn instead of two
        return self.network.gated_mlp

    @property
    def has_bias(self) -> bool:       # linears and LayerNorms carry biases
        return self.network.biases

    @property
    def learned_positions(self) -> bool:  # a position table of max_position_embeddings x h beside the tokens'
        return not self.network.rotary

    @property
    def rms_norm(self) -> bool:       # RMSNorms: fp32 copies kept
        return self.network.rms_norm

    @property
    def norms_per_layer(self) -> int:  # before attention and MLP; a sandwich adds two after them
        return self.network.norms_per_layer

    @property
    def rotary_tables(self) -> int:
        """RoPE's (cos, sin) table pairs a device holds: one shared by every layer, one per layer type where the
        types' RoPE differs, none for learned positions."""
        return self.network.rope_tables


@dataclasses.dataclass(frozen=True)
class AttentionSizes:
    """One layer's attention in numbers."""
    parameters: int        # what one tensor-parallel rank holds (tp 1: all): projections, biases, norms, sinks
    matmul_weights: int    # the whole layer's weights a token multiplies by (6N's share)
    score_width: int       # heads x (qk_dim + v_dim): channels each (query, key) pair costs in QK^T and P.V


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads one tensor-parallel rank holds: split when tp divides them, one replicated head otherwise."""
    groups = shape.num_query_groups
    return groups // tp if groups % tp == 0 else 1


def arithmetic_of(shape: ModelShape):
    """The family's own arithmetic module (its entry's `arithmetic`), or None."""
    module = shape.network.arithmetic
    return importlib.import_module(module) if module else None


def attention(shape: ModelShape, tp: int = 1) -> AttentionSizes:
    """The layer's attention: the family's own arithmetic where its entry names one, else grouped-query attention
    with a fused QKV (q rows split over tp, KV heads split or one replicated: runtime/parallel/parallelize.py)."""
    family = arithmetic_of(shape)
    if family is not None:
        return family.attention(shape, tp)
    network, h, d = shape.network, shape.hidden_size, shape.head_dim
    q_rows = shape.num_attention_heads // tp * d
    kv_rows = 2 * kv_heads_per_rank(shape, tp) * d
    qkv_bias = shape.has_bias or shape.add_qkv_bias or network.attention_biases
    proj_bias = shape.has_bias or network.attention_biases  # row-parallel: the bias whole on every rank
    parameters = h * (q_rows + kv_rows) + (q_rows + kv_rows if qkv_bias else 0) + q_rows * h + (h if proj_bias else 0)
    # q/k norms: one weight of head_dim each, shared by all heads, so every tensor-parallel rank holds both whole.
    parameters += 2 * d if shape.qk_layernorm or network.qk_norm else 0
    parameters += shape.num_attention_heads // tp if network.attention_sinks else 0  # one sink logit per head
    q, kv = shape.query_size, shape.num_query_groups * d
    return AttentionSizes(parameters, h * (q + 2 * kv) + q * h, 2 * q)


def expert_parameters(shape: ModelShape, tp: int = 1) -> int:
    """One expert's weights on one tensor-parallel rank: gate_up's 2f/tp columns and down's f/tp rows (f the
    expert's own size; two matrices without a gated MLP), and gate_up's bias where the entry has expert_biases."""
    h, f = shape.hidden_size, shape.expert_ffn_hidden_size // tp
    up = 2 * f if shape.gated_mlp else f
    return h * up + f * h + (up if shape.network.expert_biases else 0)


def moe_block_parameters(shape: ModelShape, *, experts: int, tp: int = 1) -> int:
    """An MoE block with `experts` of its experts counted (all of them, a token's top_k, or one expert-parallel
    rank's E / ep), each expert's tp-th share, and what every rank holds whole (runtime/parallel/experts.py): the
    router (E x h, with expert_biases its bias and the experts' down biases, E x h), the selection bias
    (moe.score_bias, E) and the shared experts (a SwiGLU of moe.shared_ffn_hidden_size, replicated over tp)."""
    h, moe = shape.hidden_size, shape.moe
    whole = moe.num_experts * h + (moe.num_experts * (1 + h) if shape.network.expert_biases else 0)
    whole += moe.num_experts if moe.score_bias else 0
    whole += 3 * h * shape.shared_ffn_hidden_size
    return experts * expert_parameters(shape, tp) + whole


def mlp_matmul_weights(shape: ModelShape, index: int) -> int:
    """Weights one token multiplies by in layer `index`'s MLP: the dense MLP, or of an MoE block its top_k experts,
    the router and the shared experts."""
    h, matrices = shape.hidden_size, 3 if shape.gated_mlp else 2
    if not shape.is_moe_layer(index):
        return matrices * h * shape.ffn_hidden_size
    moe = shape.moe
    return (moe.top_k * matrices * h * shape.expert_ffn_hidden_size + h * moe.num_experts
            + 3 * h * shape.shared_ffn_hidden_size)


def matmul_weights(shape: ModelShape) -> int:
    """N above: every layer's attention projections and MLP (of an MoE layer what a token uses), and the output
    layer."""
    attention_weights = attention(shape).matmul_weights
    return sum(attention_weights + mlp_matmul_weights(shape, index) for index in range(shape.num_layers)) + \
        shape.hidden_size * shape.vocab_size


def attention_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs of every layer's core attention per token: 2 x keys x score_width (QK^T and P.V)."""
    width = attention(shape).score_width
    return sum(2.0 * shape.keys_attended(index) * width for index in range(shape.num_layers))


def flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs (forward + backward) per token: 6 * N + 3 x core attention's forward, see above."""
    return 6.0 * matmul_weights(shape) + 3.0 * attention_flops_per_token(shape)
