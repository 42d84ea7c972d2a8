# GPT-OSS's network from the shared pieces: RMSNorm, one YaRN RoPE table for every layer, attention with biases on
# q, k, v and o and a learned sink logit per head (sliding-window on the layers layer_types says), and in every
# layer a SparseMoE with a biased router and biased experts running the clamped SwiGLU on interleaved gate/up
# columns (transformers' own layout, so its weights are read by name alone).
from __future__ import annotations

from runtime.models.init import Init
from runtime.models.layers import Attention, Block, RMSNorm, RotaryEmbedding
from runtime.models.moe import SparseMoE
from runtime.models.transformer import CausalLM, Embeddings
from runtime.schema.model import ModelConfig


class GptOssModel(CausalLM):
    def __init__(self, cfg: ModelConfig):
        H, eps, moe = cfg.hidden_size, cfg.layernorm_epsilon, cfg.moe
        if moe is None:
            raise ValueError("model.moe: architecture=gpt_oss has a MoE block in every layer; set model.moe")
        if moe.layers is not None or moe.frequency != 1:
            raise ValueError("model.moe.layers / frequency: architecture=gpt_oss has a MoE block in every layer; "
                             "drop them (frequency 1)")
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rotary_base, cfg.rope_scaling)
        types = cfg.layer_types or ("full_attention",) * cfg.num_layers

        def block(index: int) -> Block:
            window = cfg.sliding_window if types[index] == "sliding_attention" else None
            attn = Attention(H, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim, qkv_bias=True, proj_bias=True,
                             dropout=cfg.attention_dropout, rotary=rotary, sinks=True, window=window)
            mlp = SparseMoE(H, moe.expert_size(cfg.ffn_hidden_size), moe.num_experts, moe.top_k,
                            capacity_factor=moe.capacity_factor, activation=moe.router_activation,
                            normalize_top_k=moe.normalize_top_k_affinities, aux_loss_coef=moe.router_aux_loss_coef,
                            z_loss_coef=moe.router_z_loss_coef, router_bias=True, expert_bias=True,
                            expert_activation="clamped_swiglu")
            return Block(RMSNorm(H, eps), attn, RMSNorm(H, eps), mlp, cfg.hidden_dropout)

        super().__init__(cfg, embed=Embeddings(cfg.vocab_size, H, max_positions=None, dropout=0.0),
                         layers=[block(i) for i in range(cfg.num_layers)], final_norm=RMSNorm(H, eps))

    def init_rules(self) -> dict[str, Init]:
        """CausalLM's, plus the sinks (normal, as transformers starts them) and the experts' biases (zeros)."""
        rules = super().init_rules()
        for name, _ in self.named_parameters():
            if name.endswith(".attn.sinks"):
                rules[name] = Init("normal", self.cfg.init_method_std)
            elif name.endswith((".mlp.gate_up_bias", ".mlp.down_bias")):
                rules[name] = Init("zeros")
        return rules


MODEL = GptOssModel  # what runtime/models builds for model.architecture=gpt_oss
