# DeepSeek-V3's multi-head latent attention in numbers (model.py LatentAttention), for runtime/schema/sizes.py (its
# registry entry's `arithmetic`): what one layer holds on a tensor-parallel rank, what a token multiplies by, what
# core attention computes per key, and what autograd keeps. Standard library only: the launcher imports it.
#
#   q_a   h -> q_lora_rank, its RMSNorm (q_lora_rank), q_b  q_lora_rank -> heads x (nope + rope)
#         (without q_lora_rank one q: h -> heads x (nope + rope))
#   kv_a  h -> kv_lora_rank + rope, its RMSNorm (kv_lora_rank), kv_b  kv_lora_rank -> heads x (nope + v)
#   proj  heads x v -> h
# Under tensor parallelism q / q_b and kv_b keep the rank's heads' rows and proj their columns; the a-projections
# and their norms stay whole on every rank.
from __future__ import annotations

from runtime.schema.sizes import AttentionSizes, ModelShape


def attention(shape: ModelShape, tp: int = 1) -> AttentionSizes:
    latent, h = shape.latent_attention, shape.hidden_size
    if latent is None:
        raise ValueError("model.latent_attention: the network's latent attention needs its ranks and head sizes")
    heads = shape.num_attention_heads // tp
    qk, v = latent.qk_nope_head_dim + latent.qk_rope_head_dim, latent.v_head_dim
    kv_a = h * (latent.kv_lora_rank + latent.qk_rope_head_dim)

    def weights(heads: int) -> int:  # the projections' weights for `heads` heads, a-projections whole
        q = h * heads * qk if latent.q_lora_rank is None else \
            h * latent.q_lora_rank + latent.q_lora_rank * heads * qk
        return q + kv_a + latent.kv_lora_rank * heads * (latent.qk_nope_head_dim + v) + heads * v * h

    norms = latent.kv_lora_rank + (latent.q_lora_rank or 0)
    all_heads = shape.num_attention_heads
    return AttentionSizes(weights(heads) + norms, weights(all_heads), all_heads * (qk + v))


def activation_bytes(shape: ModelShape, tokens: int, tp: int, compute_bytes: int, *, core_kept: bool,
                     scores: float) -> float:
    """What one layer's latent attention keeps for backward on one rank, for `tokens` (micro-batch x sequence, the
    whole sequence: the layer enters it whole, runtime/families/deepseek_v3/model.py), beyond its input: each
    low-rank latent's RMSNorm keeps an fp32 copy and the fp32 normalized tensor (8 bytes an element) and the
    b-projection its output (c); q and k as core attention gets them (concatenated [nope | rope], new tensors), kv_b's
    output (v is a view of it), and the attention output, which proj saves as its input. `core_kept`: core attention
    keeps its own (`scores`: the bytes of its log-sum-exp or spelled-out matrices, the caller's), not recomputed."""
    latent, c = shape.latent_attention, compute_bytes
    heads = shape.num_attention_heads // tp
    qk, v = latent.qk_nope_head_dim + latent.qk_rope_head_dim, latent.v_head_dim
    ranks = latent.kv_lora_rank + (latent.q_lora_rank or 0)
    total = tokens * ranks * (8 + c)
    total += c * tokens * heads * (2 * qk + latent.qk_nope_head_dim + v + v)  # q, k; kv_b's output; the output
    return total + (scores if core_kept else 0.0)
