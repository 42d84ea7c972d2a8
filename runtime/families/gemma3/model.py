# Gemma 3's network, composed from runtime/models/layers.py: every norm an OffsetRMSNorm (x times 1 + weight), four
# per layer (before and after attention and MLP), q/k norms per head, GeGLU, embeddings scaled by sqrt(hidden), and
# per layer either sliding-window attention with the local RoPE base or full attention with the global, scaled one.
from __future__ import annotations

from runtime.models.layers import Attention, Block, OffsetRMSNorm, RotaryEmbedding, SwiGLU
from runtime.models.transformer import CausalLM, Embeddings
from runtime.schema.model import ModelConfig


class Gemma3Model(CausalLM):
    def __init__(self, cfg: ModelConfig):
        H, eps = cfg.hidden_size, cfg.layernorm_epsilon
        # One RoPE module per layer type, each shared by the layers of that type (see LlamaModel).
        full = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rotary_base, cfg.rope_scaling)
        local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rotary_base or cfg.rotary_base)

        def block(index: int) -> Block:
            window = cfg.attention_window(index)
            attn = Attention(H, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim, qkv_bias=False, proj_bias=False,
                             dropout=cfg.attention_dropout, rotary=full if window is None else local,
                             qk_norm_eps=eps, norm=OffsetRMSNorm, scale=cfg.softmax_scale, window=window)
            mlp = SwiGLU(H, cfg.ffn_hidden_size, dropout=cfg.ffn_dropout, activation="gelu_pytorch_tanh")
            return Block(OffsetRMSNorm(H, eps), attn, OffsetRMSNorm(H, eps), mlp, cfg.hidden_dropout,
                         attn_out_norm=OffsetRMSNorm(H, eps), mlp_out_norm=OffsetRMSNorm(H, eps))

        super().__init__(cfg,
                         embed=Embeddings(cfg.vocab_size, H, max_positions=None, dropout=0.0, scale=H ** 0.5),
                         layers=[block(i) for i in range(cfg.num_layers)],
                         final_norm=OffsetRMSNorm(H, eps))


MODEL = Gemma3Model
