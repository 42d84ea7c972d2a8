# Llama style model: RMSNorm, rotary positions (theta = rotary_base), SwiGLU MLP, grouped-query attention,
# no biases, output head untied unless share_embeddings_and_output_weights says otherwise.
from __future__ import annotations

from runtime.schema.model import ModelConfig
from runtime.models.layers import Attention, Block, RMSNorm, RotaryEmbedding, SwiGLU
from runtime.models.transformer import CausalLM, Embeddings


class LlamaModel(CausalLM):
    def __init__(self, cfg: ModelConfig):
        H, eps = cfg.hidden_size, cfg.layernorm_epsilon

        def block() -> Block:
            # One RoPE table per layer would be wasteful, but sharing one module across layers would make it
            # appear under every layer's name; the tables are small (max_positions x head_dim) buffers.
            rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rotary_base)
            attn = Attention(H, cfg.num_attention_heads, cfg.kv_heads, bias=False, dropout=cfg.attention_dropout,
                             rotary=rotary)
            return Block(RMSNorm(H, eps), attn, RMSNorm(H, eps), SwiGLU(H, cfg.ffn_hidden_size), cfg.hidden_dropout)

        super().__init__(cfg,
                         embed=Embeddings(cfg.vocab_size, H, max_positions=None, dropout=0.0),
                         layers=[block() for _ in range(cfg.num_layers)],
                         final_norm=RMSNorm(H, eps))
