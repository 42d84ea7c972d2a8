# Building blocks shared by the GPT and Llama models: norms, rotary embeddings, attention, MLPs, the loss.
# Plain modules on purpose: runtime/parallel swaps the Linear/Embedding leaves for tensor-parallel ones afterwards,
# so every forward here reads its sizes from the tensors or from attributes that parallelize_model updates.
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.init import Init
from runtime.schema.model import RopeScaling


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Where a row's tokens sit when they are not one causal sequence at positions 0..T-1: several fine-tuning
    examples packed in a row, or new tokens after a KV cache. Passed down the layers as an argument, not kept on a
    module, so activation recompute and pipeline schedules (which interleave micro-batches) see the right one.

    positions: (B, T) int64, each token's position (RoPE or learned), restarting at 0 for each packed example.
    mask: (B, 1, T, S) bool, True where query t may attend key s (S = T, or the cache's length).

    Under a context group (runtime/parallel/context.py) a rank holds only some of a row's tokens, so the layout is
    the whole row's instead: positions (B, T·cp), documents (B, T·cp) int64 (which document each token belongs to)
    and no mask. The rank's own positions are picked by the context seam (RotaryEmbedding/Embeddings.positions),
    and its attention (ring or Ulysses) builds each block's mask from the documents.
    """

    positions: torch.Tensor
    mask: torch.Tensor | None
    documents: torch.Tensor | None = None

    @classmethod
    def packed(cls, position_ids: torch.Tensor) -> "SequenceLayout":
        """Examples laid end to end, each starting at position 0: causal attention within an example only, so a
        packed row gives each example exactly the loss it has alone."""
        T = position_ids.shape[1]
        example = (position_ids == 0).cumsum(dim=1)  # (B, T): which example each token belongs to
        causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
        return cls(position_ids, ((example[:, :, None] == example[:, None, :]) & causal).unsqueeze(1))

    @classmethod
    def context_split(cls, position_ids: torch.Tensor) -> "SequenceLayout":
        """The whole row's layout for a rank that holds part of it (see above): `position_ids` (B, T·cp)."""
        return cls(position_ids, None, (position_ids == 0).cumsum(dim=1))


def document_mask(documents: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1, len(queries), len(keys)) bool: True where the query at whole-row index queries[i] may attend the key
    at keys[j], both in the same document (and j's index not after i's, when `causal`)."""
    same = documents[:, queries][:, :, None] == documents[:, keys][:, None, :]
    if causal:
        same = same & (keys[None, :] <= queries[:, None])
    return same.unsqueeze(1)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 so bf16 activations keep their precision."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class OffsetRMSNorm(RMSNorm):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in fp32 (a norm whose weight starts at zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)

    def init_rules(self, prefix: str) -> dict[str, Init]:
        return {f"{prefix}.weight": Init("zeros")}


def rope_inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE's d/2 angular frequencies in float64, scaled as `scaling` says (transformers' rope_init_functions for
    'llama3' and 'linear', the same formulas; the attention factor of both is 1, so only the frequencies change)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, base, scaling)
    # llama3: long wavelengths (past what the original context saw whole) slowed by `factor`, short ones kept,
    # and a linear blend between the two wavelength bounds.
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long = wavelength > original / scaling.low_freq_factor
    short = wavelength < original / scaling.high_freq_factor
    smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(long, inv_freq / scaling.factor, torch.where(short, inv_freq, blended))


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: RopeScaling
                              ) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): dims turning fewer than beta_slow times over the original
    context are interpolated (divided by `factor`), those turning more than beta_fast times kept, and a linear ramp
    between the two bounds (floored and ceiled when `truncate`)."""

    def dim_turning(turns: float) -> float:  # the dim whose frequency makes `turns` turns in the original context
        return head_dim * math.log(scaling.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature, so 1/sqrt(d) softmax logits scale by its
    square); 1.0 for every other RoPE."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(factor: float, scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


class RotaryEmbedding(nn.Module):
    """RoPE tables in the 'rotate half' layout (Megatron/NeMo/HF): dims [0, d/2) pair with [d/2, d).

    One instance serves every layer of a model (its tables depend only on the config): at Llama 3.1's 131072
    positions and head size 128 they are 128 MiB, which per layer would be 4 GiB for the 8B model."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.base, self.scaling = head_dim, max_positions, base, scaling
        # Non-persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_parameters()
        # Seam for context parallelism: the tables at a rank's T tokens' positions when they are not 0..T-1
        # (runtime/parallel/context.py's ContextPositions.rotary_tables).
        self.positions = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.cos.is_meta:  # built on the meta device: the tables are computed once the buffers are real
            return
        inv_freq = rope_inverse_frequencies(self.head_dim, self.base, self.scaling)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq)  # (P, d/2)
        angles = torch.cat([angles, angles], dim=-1)                                             # (P, d)
        factor = rope_attention_factor(self.scaling)
        self.cos.copy_(angles.cos() * factor)
        self.sin.copy_(angles.sin() * factor)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q, k: (B, T, heads, d); tables broadcast over batch and heads. positions: (B, T), a SequenceLayout's.
        T = q.shape[1]
        if positions is not None and positions.shape[1] != T and self.positions is not None:
            positions = positions[:, self.positions(T, q.device)]  # the whole row's, under a context group
        if positions is not None:
            cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # (B, T, 1, d)
        elif self.positions is None:
            cos, sin = self.cos[:T, None, :], self.sin[:T, None, :]  # (T, 1, d)
        else:
            cos, sin = self.positions.rotary_tables(self, T, q.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half(x)
    return torch.addcmul(x * cos, rotated, sin)


def sliding_window_mask(queries: int, keys: int, window: int, device, first: int | None = None) -> torch.Tensor:
    """(queries, keys) bool: True where query i, at key index first + i (None: the last `queries` of the keys), may
    attend key j: causal and fewer than `window` positions back (transformers' sliding_window: j > i - window)."""
    first = keys - queries if first is None else first
    i = torch.arange(first, first + queries, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    return (j <= i) & (j > i - window)


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + causal) v, scale 1/sqrt(d) unless given; with `window`, each query sees only the
    keys fewer than `window` positions back (sliding-window attention); with `sinks`, each head's learned logit
    joins every softmax denominator (attention sinks). Its own module so selective activation checkpointing can
    target it."""

    def __init__(self, dropout: float, *, scale: float | None = None, window: int | None = None):
        super().__init__()
        self.dropout, self.scale, self.window = dropout, scale, window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                first_query: int | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: (B, nh, T, d); k, v: (B, ng, S, d) with nh a multiple of ng (GQA). mask: a SequenceLayout's, else
        # plain causal (S = T). first_query: the key index of query 0 (a KV cache's filled length before this
        # call; None: the queries are the last T keys), which only the window reads. sinks: (nh,) per-head logits.
        if k.shape[1] != q.shape[1]:
            # Expanding here keeps SDPA on its fastest kernel; enable_gqa is not fused on every backend.
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)  # (B, nh, S, d)
            v = v.repeat_interleave(repeat, dim=1)
        if self.window is not None:
            band = sliding_window_mask(q.shape[2], k.shape[2], self.window, q.device, first_query)
            mask = band if mask is None else mask & band
        if sinks is not None:
            return self._with_sinks(q, k, v, mask, sinks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=self.dropout if self.training else 0.0, scale=self.scale)

    def _with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    sinks: torch.Tensor) -> torch.Tensor:
        """Attention sinks (GPT-OSS): each head's learned logit joins every row's softmax denominator and attends
        to nothing, so a query may give less than all of its attention to the keys. Spelled out: SDPA has no
        place for the extra column."""
        B, nh, T, S = *q.shape[:3], k.shape[2]
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale                                 # (B, nh, T, S)
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~mask, float("-inf"))
        column = sinks.to(scores.dtype).view(1, nh, 1, 1).expand(B, nh, T, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]       # the sink dropped
        probs = F.dropout(probs, self.dropout, self.training)
        return torch.matmul(probs.to(v.dtype), v)                                          # (B, nh, T, d)


class Attention(nn.Module):
    """Causal self-attention with one fused QKV projection laid out [Q (nh*d) | K (ng*d) | V (ng*d)]
    (ModelConfig.fused_segments), optionally with an RMSNorm over each query and key head before RoPE (Qwen3's
    q_norm / k_norm: weights of size d shared by all heads; `norm` makes them another RMSNorm class). `scale` and
    `window` are CoreAttention's (a softmax scale of its own, sliding-window attention); `sinks` gives each head a
    learned logit in every softmax denominator (attention sinks).

    `num_heads` / `num_kv_heads` are the heads this module computes; tensor parallelism lowers them to the
    rank's share after slicing `qkv` and `proj`.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, qkv_bias: bool,
                 proj_bias: bool, dropout: float, rotary: RotaryEmbedding | None, qk_norm_eps: float | None = None,
                 norm: type[RMSNorm] = RMSNorm, scale: float | None = None, window: int | None = None,
                 sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.q_norm = norm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = norm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.core_attention = CoreAttention(dropout, scale=scale, window=window)
        self.proj = nn.Linear(num_heads * head_dim, hidden, bias=proj_bias)
        self.rotary = rotary
        # Tensor parallelism keeps the rank's heads' entries of the sinks.
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # Seam for generation (runtime/generate.py): an object whose update(k, v) appends this step's keys and
        # values (B, T, ng, d) and returns all of them so far; the SequenceLayout's mask then covers them.
        self.kv_cache = None

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, (nh + 2 ng) d); T is the full sequence even when x is a sequence shard
        B, T = qkv.shape[:2]
        nh, ng, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([nh * d, ng * d, ng * d], dim=-1)
        q, k, v = q.view(B, T, nh, d), k.view(B, T, ng, d), v.view(B, T, ng, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, None if layout is None else layout.positions)
        cached = {}
        if self.kv_cache is not None:
            cached = {"first_query": self.kv_cache.length}  # where these queries' keys go in the cache
            k, v = self.kv_cache.update(k, v)  # (B, S, ng, d): the cached tokens, then these
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        # Without a layout the call stays (q, k, v): context parallelism's attentions take exactly that, and a
        # context-split row's documents.
        if layout is None:
            y = self.core_attention(q, k, v, **cached, **extra)
        elif layout.documents is not None:
            y = self.core_attention(q, k, v, documents=layout.documents, **extra)
        else:
            y = self.core_attention(q, k, v, layout.mask, **cached, **extra)
        y = y.transpose(1, 2).reshape(B, T, nh * d)  # (B, T, nh d)
        return self.proj(y)


def ffn_dropout(p: float) -> nn.Module:
    """Megatron's ffn_dropout: on the MLP's hidden units, after the activation, before the output projection.
    An identity at 0, so a model without it runs exactly the ops it ran before. Under tensor parallelism each rank
    drops units of its own shard of the hidden units, drawing from the generator every rank seeds alike, as the
    attention dropout on its heads does."""
    return nn.Dropout(p) if p else nn.Identity()


class GeluMLP(nn.Module):
    """GPT-3 MLP: fc2(drop(gelu(fc1(x))))."""

    def __init__(self, hidden: int, ffn: int, *, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)
        self.dropout = ffn_dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh approximation as in GPT-2/3; one fused kernel rather than the formula spelled out.
        return self.fc2(self.dropout(F.gelu(self.fc1(x), approximate="tanh")))  # (B, T, ffn) in the middle


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gated MLPs' activations by Hugging Face's hidden_act name: SwiGLU's silu, GeGLU's tanh-approximated gelu.
GATE_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class SwiGLU(nn.Module):
    """Gated MLP: down(drop(act(gate(x)) * up(x))), with gate and up fused into one matmul laid out [gate | up].
    act: silu (Llama's SwiGLU) or gelu_pytorch_tanh (GeGLU), GATE_ACTIVATIONS' names."""

    def __init__(self, hidden: int, ffn: int, *, dropout: float = 0.0, activation: str = "silu"):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.dropout = ffn_dropout(dropout)
        self.activation = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, ffn) each; the local share under TP
        return self.down(self.dropout(self.activation(gate) * up))


class Block(nn.Module):
    """Pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))). With `attn_out_norm` and
    `mlp_out_norm` (sandwich norms) each branch's output is normed too before the residual add."""

    def __init__(self, attn_norm: nn.Module, attn: Attention, mlp_norm: nn.Module, mlp: nn.Module, dropout: float,
                 *, attn_out_norm: nn.Module | None = None, mlp_out_norm: nn.Module | None = None):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        self.attn_out_norm, self.mlp_out_norm = attn_out_norm, mlp_out_norm
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        y = self.attn(self.attn_norm(x), layout)
        x = x + self.dropout(y if self.attn_out_norm is None else self.attn_out_norm(y))
        y = self.mlp(self.mlp_norm(x))
        return x + self.dropout(y if self.mlp_out_norm is None else self.mlp_out_norm(y))


class _CrossEntropy(torch.autograd.Function):
    """loss_n = log(sum_v exp(z_nv)) - z_n,label, computed in place on the logits, softmax kept for backward.

    F.cross_entropy allocates log-probabilities, a zero-filled gradient and a log-softmax gradient, each as big as
    the logits (T x V: the largest activations of the model). Here the logits buffer itself becomes exp(z - max)
    in forward and the gradient in backward: dz = softmax(z) * dloss - onehot(label) * dloss.

    `reduce` lets tensor parallelism reuse this with the vocabulary split over ranks: it supplies this shard's
    first vocabulary index and the all-reduces (max, then sum) that combine the per-shard statistics.
    `padding_from`: the vocabulary's first padded index (ModelConfig.padding_from), from which z is -inf, so that
    exp(z - m) and the gradient are exactly 0 there (a shard of padding alone: its max is -inf, the others' wins).
    """

    @staticmethod
    def forward(ctx, logits, labels, reduce, padding_from):
        # fp32 logits are overwritten (like Megatron's vocab-parallel CE): nothing else reads them, and autograd
        # saved only the matmul's inputs. Other dtypes get a fresh fp32 copy.
        z = logits.detach().float() if logits.dtype != torch.float32 else logits.detach()  # (N, V)
        local_vocab = z.shape[-1]
        if padding_from is not None and padding_from < reduce.vocab_start + local_vocab:
            z[:, max(padding_from - reduce.vocab_start, 0):] = float("-inf")
        local_labels = labels - reduce.vocab_start
        outside = (local_labels < 0) | (local_labels >= local_vocab)
        local_labels = local_labels.masked_fill(outside, 0)
        m = reduce.max(z.max(dim=-1).values)                                           # (N,)
        label_logit = z.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.sub_(m.unsqueeze(-1)).exp_()                                           # exp(z - m), in place
        sums = reduce.sum(torch.stack([exp.sum(dim=-1), label_logit]))               # (2, N)
        sum_exp, label_logit = sums[0], sums[1] - m
        ctx.save_for_backward(exp, sum_exp, local_labels, outside)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - label_logit

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_labels, outside = ctx.saved_tensors
        grad = exp.mul_((grad_loss / sum_exp).unsqueeze(-1))  # softmax * dloss, reusing the saved buffer
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_labels] -= grad_loss.masked_fill(outside, 0.0)
        return grad.to(ctx.logits_dtype), None, None, None


class _WholeVocabulary:
    """The `reduce` of an unsharded vocabulary: nothing to combine."""

    vocab_start = 0

    @staticmethod
    def max(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def sum(x: torch.Tensor) -> torch.Tensor:
        return x


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduce=_WholeVocabulary,
                  padding_from: int | None = None) -> torch.Tensor:
    """(..., V) logits and (...) labels -> (...) per-token loss in fp32; equals F.cross_entropy(reduction='none')
    over the logits before `padding_from` (None: all of them).

    Overwrites fp32 logits (see _CrossEntropy): pass a clone if you still need them.
    """
    loss = _CrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), reduce, padding_from)
    return loss.view(labels.shape)


def mask_padded_vocab(logits: torch.Tensor, padding_from: int | None) -> torch.Tensor:
    """(..., V) full logits -> the same with those of the padded rows (from `padding_from` on) at -inf, so that
    no softmax, sampling or argmax over them sees a token the source model does not have."""
    if padding_from is None:
        return logits
    return logits.index_fill(-1, torch.arange(padding_from, logits.shape[-1], device=logits.device), float("-inf"))


class TokenCrossEntropy(nn.Module):
    """Per-token cross entropy (B, T, V) x (B, T) -> (B, T), in fp32, without shifting or copying the logits.

    Tensor parallelism replaces this with a vocab-parallel version that works on (B, T, V/tp) shards.
    padding_from: ModelConfig.padding_from, the padded rows kept out of the softmax.
    """

    def __init__(self, padding_from: int | None = None):
        super().__init__()
        self.padding_from = padding_from

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels, padding_from=self.padding_from)
