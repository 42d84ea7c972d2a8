# A torchtitan ModelSpec for our recipe's model shape: the generated job module (templates/torchtitan/job.py.j2)
# names the family and spells out the shape, and this builds torchtitan's own model config of that shape, so the
# recipe (not a torchtitan flavor name) picks the model. Per-layer initialization stays torchtitan's: the layers
# come from the same builders its flavors use (pinned to torchtitan 0.3.0, whose models/<family>/__init__.py
# defines them).
from __future__ import annotations

from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.protocols.model_spec import ModelSpec

FAMILIES = ("llama3", "qwen3")


def model_spec(family: str, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int | None, hidden_dim: int,
               vocab_size: int, rope_theta: float, norm_eps: float, max_seq_len: int, tie_embeddings: bool,
               head_dim: int | None = None, qk_norm: bool = True, attn_backend: str = "flex") -> ModelSpec:
    """torchtitan's ModelSpec (model config, parallelize and pipelining functions, HF state-dict adapter) of
    `family` with this shape. attn_backend is torchtitan's ("flex" or "varlen"): both take the per-document
    positions our dataloader gives (runtime/titan/data.py), which make one causal block per sample."""
    shape = dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads or n_heads,
                 hidden_dim=hidden_dim, vocab_size=vocab_size, rope_theta=float(rope_theta),
                 max_seq_len=max_seq_len, tie_embeddings=bool(tie_embeddings), attn_backend=attn_backend)
    if family == "llama3":
        if head_dim not in (None, dim // n_heads):
            raise ValueError(f"model.head_dim: llama3 uses dim / n_heads = {dim // n_heads}, not {head_dim}")
        spec = _llama3(**shape)
    elif family == "qwen3":
        spec = _qwen3(**shape, head_dim=head_dim or dim // n_heads, qk_norm=qk_norm)
    else:
        raise ValueError(f"family: {family!r} is not one torchtitan trains here; choose one of {FAMILIES}")
    # torchtitan's builders leave every norm at its default eps; the recipe's applies to all of them.
    for _, norm, _, _ in spec.model.traverse(RMSNorm.Config):
        norm.eps = float(norm_eps)
    return spec


def _embeddings_and_head(module, dim: int, vocab_size: int, tie_embeddings: bool, head_init: dict) -> dict:
    """The Decoder.Config fields around the layers, with the family's own initializers (`module`: its package)."""
    embedding_init = module._EMBEDDING_SKIP_INIT if tie_embeddings else module._EMBEDDING_INIT
    return dict(
        dim=dim, vocab_size=vocab_size, enable_weight_tying=tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=embedding_init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=module._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=head_init),
    )


def _llama3(*, dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size, rope_theta, max_seq_len,
            tie_embeddings, attn_backend) -> ModelSpec:
    from torchtitan.models import llama3

    # No rope scaling: the shape has none (Llama 3.1's long-context scaling is not a key of the launch).
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=rope_theta, scaling="none")
    layers = llama3._build_llama3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                         hidden_dim=hidden_dim, rope=rope, attn_backend=attn_backend)
    config = llama3.Llama3Model.Config(
        **_embeddings_and_head(llama3, dim, vocab_size, tie_embeddings, llama3._output_linear_init(dim)),
        layers=layers)
    return _spec("llama3", config, llama3.parallelize_llama, llama3.Llama3StateDictAdapter)


def _qwen3(*, dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size, rope_theta, max_seq_len,
           tie_embeddings, attn_backend, head_dim, qk_norm) -> ModelSpec:
    from torchtitan.models import qwen3

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=rope_theta)
    layers = qwen3._build_qwen3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                       head_dim=head_dim, hidden_dim=hidden_dim, attn_backend=attn_backend,
                                       rope=rope)
    if not qk_norm:  # torchtitan's Qwen3 layers always norm q and k; a recipe may say not to
        for layer in layers:
            layer.attention.qk_norm = None
    config = qwen3.Qwen3Model.Config(
        **_embeddings_and_head(qwen3, dim, vocab_size, tie_embeddings, qwen3._LINEAR_INIT), layers=layers)
    return _spec("qwen3", config, qwen3.parallelize_qwen3, qwen3.Qwen3StateDictAdapter)


def _spec(name: str, config, parallelize_fn, adapter) -> ModelSpec:
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    # flavor: no torchtitan flavor names this shape; the logs say "<name> custom".
    return ModelSpec(name=name, flavor="custom", model=config, parallelize_fn=parallelize_fn,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None, state_dict_adapter=adapter)
