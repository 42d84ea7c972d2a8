# The Llama decoder's network: RMSNorm, rotary positions (theta = rotary_base, optionally scaled), SwiGLU MLP,
# grouped-query attention, no biases (Qwen2: on q, k and v; Qwen3: RMSNorm on each query and key head), output head
# untied unless share_embeddings_and_output_weights says otherwise. With model.moe it is Mixtral: a sparse MoE block
# (runtime/models/moe.py) in place of the MLP of the MoE layers (moe.frequency or moe.layers); Qwen3-MoE's experts
# have a size of their own (moe.ffn_hidden_size).
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
                return SwiGLU(H, cfg.ffn_hidden_size, dropout=cfg.ffn_dropout)
            return SparseMoE(H, moe.expert_size(cfg.ffn_hidden_size), moe.num_experts, moe.top_k,
                             capacity_factor=moe.capacity_factor, activation=moe.router_activation,
                             normalize_top_k=moe.normalize_top_k_affinities,
                             aux_loss_coef=moe.router_aux_loss_coef, z_loss_coef=moe.router_z_loss_coef)

        # One RoPE module shared by every layer: its tables (non-persistent buffers, in no state dict) can be
        # large, and module traversals name it once (`layers.0.attn.rotary`).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rotary_base, cfg.rope_scaling)

        def block(index: int) -> Block:
            attn = Attention(H, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim, qkv_bias=cfg.add_qkv_bias,
                             proj_bias=False, dropout=cfg.attention_dropout, rotary=rotary,
                             qk_norm_eps=eps if cfg.qk_layernorm else None)
            return Block(RMSNorm(H, eps), attn, RMSNorm(H, eps), mlp(index), cfg.hidden_dropout)

        super().__init__(cfg,
                         embed=Embeddings(cfg.vocab_size, H, max_positions=None, dropout=0.0),
                         layers=[block(i) for i in range(cfg.num_layers)],
                         final_norm=RMSNorm(H, eps))


MODEL = LlamaModel  # what runtime/models builds for model.architecture=llama (and every variant here)
