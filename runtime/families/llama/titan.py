# torchtitan 0.3's models of this folder's networks (training.runtime=torchtitan, checkpoint conversion): its Llama 3
# (our llama at Llama 3 shapes, Llama 3.1's RoPE scaling included) and its dense Qwen3, built at our shape by the same
# per-layer builders its own flavors use (pinned to torchtitan 0.3.0, whose models/<model>/__init__.py defines them),
# so initialization stays torchtitan's. runtime/titan/model.py finds this module through the registry
# (runtime/schema/families torchtitan_builder); the shape's keys are runtime/titan/shape.py's.
from __future__ import annotations

from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear


def model_config(name: str, *, dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size, rope_theta, max_seq_len,
                 tie_embeddings, head_dim, qk_norm, rope_scaling, attn_backend):
    """(torchtitan's model config of `name` at this shape, its parallelize function, its HF state-dict adapter)."""
    if name == "llama3":
        return _llama3(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=hidden_dim,
                       vocab_size=vocab_size, rope_theta=rope_theta, max_seq_len=max_seq_len,
                       tie_embeddings=tie_embeddings, head_dim=head_dim, rope_scaling=rope_scaling,
                       attn_backend=attn_backend)
    if rope_scaling is not None:
        raise ValueError(f"model.rope_scaling: torchtitan's {name} takes none")
    return _qwen3(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=hidden_dim,
                  vocab_size=vocab_size, rope_theta=rope_theta, max_seq_len=max_seq_len, tie_embeddings=tie_embeddings,
                  head_dim=head_dim or dim // n_heads, qk_norm=qk_norm, attn_backend=attn_backend)


def _outer(module, dim: int, vocab_size: int, tie_embeddings: bool, head_init: dict) -> dict:
    """The Decoder.Config fields around the layers, with the model's own initializers (`module`: its package)."""
    from torchtitan.models.common import RMSNorm

    embedding_init = module._EMBEDDING_SKIP_INIT if tie_embeddings else module._EMBEDDING_INIT
    return dict(
        dim=dim, vocab_size=vocab_size, enable_weight_tying=tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=embedding_init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=module._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=head_init),
    )


def _llama3(*, dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size, rope_theta, max_seq_len, tie_embeddings,
            head_dim, rope_scaling, attn_backend):
    from torchtitan.models import llama3

    if head_dim not in (None, dim // n_heads):
        raise ValueError(f"model.head_dim: torchtitan's llama3 uses dim / n_heads = {dim // n_heads}, not {head_dim}")
    scaling = {"scaling": "none"} if rope_scaling is None else {
        "scaling": "llama", "scaling_factor": rope_scaling["factor"],
        "low_freq_factor": rope_scaling["low_freq_factor"], "high_freq_factor": rope_scaling["high_freq_factor"],
        "original_max_position_embeddings": rope_scaling["original_max_position_embeddings"]}
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=rope_theta, **scaling)
    layers = llama3._build_llama3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                         hidden_dim=hidden_dim, rope=rope, attn_backend=attn_backend)
    config = llama3.Llama3Model.Config(
        **_outer(llama3, dim, vocab_size, tie_embeddings, llama3._output_linear_init(dim)), layers=layers)
    return config, llama3.parallelize_llama, llama3.Llama3StateDictAdapter


def _qwen3(*, dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size, rope_theta, max_seq_len, tie_embeddings,
           head_dim, qk_norm, attn_backend):
    from torchtitan.models import qwen3

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=rope_theta)
    layers = qwen3._build_qwen3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                       head_dim=head_dim, hidden_dim=hidden_dim, attn_backend=attn_backend, rope=rope)
    if not qk_norm:  # torchtitan's Qwen3 layers always norm q and k; a recipe may say not to
        for layer in layers:
            layer.attention.qk_norm = None
    config = qwen3.Qwen3Model.Config(**_outer(qwen3, dim, vocab_size, tie_embeddings, qwen3._LINEAR_INIT),
                                     layers=layers)
    return config, qwen3.parallelize_qwen3, qwen3.Qwen3StateDictAdapter
