# Llama style model: RMSNorm, rotary positions (theta = rotary_base), SwiGLU MLP, grouped-query attention,
# no biases, output head untied unless share_embeddings_and_output_weights says otherwise. With model.moe it is
# Mixtral: a sparse MoE block (runtime/models/moe.py) in place of the MLP of every moe.frequency-th layer.
from __future__ import annotations

from runtime.schema.model import ModelConfig
from runtime.models.layers import Attention, Block, RMSNorm, RotaryEmbedding, SwiGLU
from runtime.models.moe import SparseMoE
from runtime.models.transformer import CausalLM, Embeddings


class LlamaModel(CausalLM):
    def __init__(self, cfg: ModelConfig):
        H, eps = cfg.hidden_size, cfg.layernorm_epsilon

        def mlp(index: int):
            moe = cfg.moe
            if moe is None or not moe.is_moe_layer(index):
                return SwiGLU(H, cfg.ffn_hidden_size)
            return SparseMoE(H, cfg.ffn_hidden_size, moe.num_experts, moe.top_k,
                             capacity_factor=moe.capacity_factor, activation=moe.router_activation,
                             normalize_top_k=moe.normalize_top_k_affinities,
                             aux_loss_coef=moe.router_aux_loss_coef, z_loss_coef=moe.router_z_loss_coef)

        def block(index: int) -> Block:
            # One RoPE table per layer would be wasteful, but sharing one module across layers would make it
            # appear under every layer's name; the tables are small (max_positions x head_dim) buffers.
            rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rotary_base)
            attn = Attention(H, cfg.num_attention_heads, cfg.kv_heads, bias=False, dropout=cfg.attention_dropout,
                             rotary=rotary)
            return Block(RMSNorm(H, eps), attn, RMSNorm(H, eps), mlp(index), cfg.hidden_dropout)

        super().__init__(cfg,
                         embed=Embeddings(cfg.vocab_size, H, max_positions=None, dropout=0.0),
                         layers=[block(i) for i in range(cfg.num_layers)],
                         final_norm=RMSNorm(H, eps))
