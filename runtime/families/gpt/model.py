# GPT's network, GPT-3 style: learned absolute positions, LayerNorm, GELU MLP, biases everywhere, optionally tied
# output.
from __future__ import annotations

from torch import nn

from runtime.schema.model import ModelConfig
from runtime.models.layers import Attention, Block, GeluMLP
from runtime.models.transformer import CausalLM, Embeddings


class GPTModel(CausalLM):
    def __init__(self, cfg: ModelConfig):
        H, eps = cfg.hidden_size, cfg.layernorm_epsilon

        def block() -> Block:
            attn = Attention(H, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim, qkv_bias=True, proj_bias=True,
                             dropout=cfg.attention_dropout, rotary=None)
            return Block(nn.LayerNorm(H, eps=eps), attn, nn.LayerNorm(H, eps=eps),
                         GeluMLP(H, cfg.ffn_hidden_size, bias=True, dropout=cfg.ffn_dropout), cfg.hidden_dropout)

        super().__init__(cfg,
                         embed=Embeddings(cfg.vocab_size, H, max_positions=cfg.max_position_embeddings,
                                          dropout=cfg.hidden_dropout),
                         layers=[block() for _ in range(cfg.num_layers)],
                         final_norm=nn.LayerNorm(H, eps=eps))


MODEL = GPTModel  # what runtime/models builds for model.architecture=gpt
