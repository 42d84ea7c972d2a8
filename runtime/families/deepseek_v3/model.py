# DeepSeek-V3's network: RMSNorm, multi-head latent attention (below, the one module of its own), the first
# first_k_dense_replace layers' SwiGLU, then the shared SparseMoE with DeepSeek's switches (sigmoid scores with a
# selection bias, group-limited top-k, routed_scaling_factor, shared experts).
from __future__ import annotations

import math

import torch
from torch import nn

from runtime.families.deepseek_v3.weights import attention_names
from runtime.models.layers import Block, CoreAttention, RMSNorm, RotaryEmbedding, SequenceLayout, SwiGLU
from runtime.models.moe import SparseMoE
from runtime.models.transformer import CausalLM, Embeddings
from runtime.parallel import collectives as C
from runtime.parallel import layers as L
from runtime.schema.model import ModelConfig

_LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm take DeepseekV3RMSNorm's default, not rms_norm_eps


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk_nope + qk_rope), times YaRN's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale)."""
    latent, rope = cfg.latent_attention, cfg.rope_scaling
    scale = (latent.qk_nope_head_dim + latent.qk_rope_head_dim) ** -0.5
    if rope is not None and rope.mscale_all_dim and rope.factor > 1:
        scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
    return scale


class LatentAttention(nn.Module):
    """Multi-head latent attention. q = q_b(q_a_norm(q_a(x))) (or q(x) without q_lora_rank), [c | k_rope] =
    kv_a(x), [k_nope | v] per head = kv_b(kv_a_norm(c)); each head's key is [k_nope | k_rope] with k_rope shared by
    every head; RoPE on the qk_rope_head_dim channels only (their pairs interleaved when rope_interleave, as
    DeepSeek's checkpoints lay them out: de-interleaved here, which changes no dot product).

    `num_heads` is the heads this module computes: tensor parallelism lowers it after slicing q / q_b and kv_b by
    head (column-parallel) and proj (row-parallel); the a-projections and their norms stay whole on every rank."""

    # Not built for it: ring / Ulysses attention, and generation's KV cache (runtime/generate.py refuses).
    no_context_parallel = no_kv_cache = "multi-head latent attention"

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        latent, H, heads = cfg.latent_attention, cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.nope, self.rope = heads, latent.qk_nope_head_dim, latent.qk_rope_head_dim
        self.v_dim, self.kv_rank, self.interleave = latent.v_head_dim, latent.kv_lora_rank, latent.rope_interleave
        qk = self.nope + self.rope
        if latent.q_lora_rank is None:
            self.q = nn.Linear(H, heads * qk, bias=False)
        else:
            self.q_a = nn.Linear(H, latent.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(latent.q_lora_rank, _LATENT_EPS)
            self.q_b = nn.Linear(latent.q_lora_rank, heads * qk, bias=False)
        self.kv_a = nn.Linear(H, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, _LATENT_EPS)
        self.kv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.core_attention = CoreAttention(cfg.attention_dropout, scale=softmax_scale(cfg))
        self.proj = nn.Linear(heads * self.v_dim, H, bias=False)
        self.rotary = rotary
        # Tensor parallelism's (parallelize): how x enters the rank's heads (whole, its input gradient summed over
        # the ranks), and the replicated weights each rank's heads give only part of the gradient of.
        self.enter = nn.Identity()
        self.partial_grads: tuple[str, ...] = ()

    def parallelize(self, axis, sequence_parallel: bool) -> None:
        """The rank's heads: x enters whole once (gathered along the sequence under sequence parallelism), the
        low-rank a-projections and their norms run replicated on it, q / q_b and kv_b keep the rank's heads' rows
        (each head's rows are contiguous), proj their columns (row-parallel, reduced or reduce-scattered)."""
        self.enter = _EnterHeads(axis, sequence_parallel)
        for name in ("q", "q_b", "kv_b"):
            if hasattr(self, name):
                setattr(self, name, _HeadRows.from_linear(getattr(self, name), axis, sequence_parallel=False))
        self.proj = L.RowParallelLinear(self.proj, axis, sequence_parallel=sequence_parallel)
        self.num_heads //= axis.size
        # LoRA's adapters on q_a / kv_a (A and B) are whole on every rank too, their gradients as partial.
        self.partial_grads = tuple(f"{module}.{name}" for module in ("q_a", "q_a_norm", "kv_a", "kv_a_norm")
                                   if hasattr(self, module) for name, _ in getattr(self, module).named_parameters())

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleave else x

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        x = self.enter(x)
        B, T = x.shape[:2]
        nh = self.num_heads
        q = self.q(x) if hasattr(self, "q") else self.q_b(self.q_a_norm(self.q_a(x)))
        q_nope, q_rope = q.view(B, T, nh, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(B, T, nh, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope, k_rope = self.rotary(self._rope_layout(q_rope), self._rope_layout(k_rope).unsqueeze(2),
                                     None if layout is None else layout.positions)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)                            # (B, nh, T, qk)
        k = torch.cat([k_nope, k_rope.expand(B, T, nh, self.rope)], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if layout is None:
            y = self.core_attention(q, k, v)
        elif layout.documents is not None:
            y = self.core_attention(q, k, v, documents=layout.documents)
        else:
            y = self.core_attention(q, k, v, layout.mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, nh * self.v_dim))


class _EnterHeads(nn.Module):
    """x -> x whole on every tensor-parallel rank: copied (its gradient summed over the ranks in backward), or
    gathered along the sequence under sequence parallelism (reduce-scattered in backward)."""

    def __init__(self, axis, sequence_parallel: bool):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return C.gather_from_sequence(x, self.axis)
        return C.copy_to_region(x, self.axis)


class _HeadRows(L.ColumnParallelLinear):
    """A column-parallel linear whose input is already whole on the rank (LatentAttention's enter)."""

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DeepseekV3Model(CausalLM):
    def __init__(self, cfg: ModelConfig):
        H, eps, moe, latent = cfg.hidden_size, cfg.layernorm_epsilon, cfg.moe, cfg.latent_attention
        if moe is None or latent is None:
            raise ValueError("model.moe / model.latent_attention: architecture=deepseek_v3 needs both (import a "
                             "DeepseekV3ForCausalLM config.json for them)")
        rotary = RotaryEmbedding(latent.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rotary_base,
                                 cfg.rope_scaling)

        def block(index: int) -> Block:
            if moe.is_moe_layer(index):
                mlp = SparseMoE(H, moe.expert_size(cfg.ffn_hidden_size), moe.num_experts, moe.top_k,
                                capacity_factor=moe.capacity_factor, activation=moe.router_activation,
                                normalize_top_k=moe.normalize_top_k_affinities,
                                aux_loss_coef=moe.router_aux_loss_coef, z_loss_coef=moe.router_z_loss_coef,
                                score_bias=moe.score_bias, groups=moe.groups, top_groups=moe.top_groups,
                                scale=moe.routed_scaling_factor, shared_ffn=moe.shared_ffn_hidden_size)
            else:
                mlp = SwiGLU(H, cfg.ffn_hidden_size)
            return Block(RMSNorm(H, eps), LatentAttention(cfg, rotary), RMSNorm(H, eps), mlp, cfg.hidden_dropout)

        super().__init__(cfg, embed=Embeddings(cfg.vocab_size, H, max_positions=None, dropout=0.0),
                         layers=[block(i) for i in range(cfg.num_layers)], final_norm=RMSNorm(H, eps))

    @staticmethod
    def lora_projections(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
        """What LoRA adapts (runtime/models/lora.py), by path in a block: (Hugging Face name, in, out features) of
        each latent-attention projection; the MoE layers' experts carry none (a schema rule refuses MLP targets)."""
        with torch.device("meta"):
            attention = LatentAttention(cfg, rotary=None)
        names = attention_names(cfg.latent_attention)
        return {f"attn.{name}": (names[name], module.in_features, module.out_features)
                for name, module in attention.named_children() if isinstance(module, nn.Linear)}


MODEL = DeepseekV3Model  # what runtime/models builds for model.architecture=deepseek_v3
