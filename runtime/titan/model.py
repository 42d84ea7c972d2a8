# A torchtitan ModelSpec for our recipe's model shape: the generated job module (templates/torchtitan/job.py.j2)
# names torchtitan's model and spells out the shape (runtime/titan/shape.py's keys), and the family folder that
# names that model builds torchtitan's own config of it (runtime/families/<folder>/titan.py, found through the
# registry), so the recipe, not a torchtitan flavor name, picks the model.
from __future__ import annotations

import importlib

from torchtitan.models.common import RMSNorm
from torchtitan.protocols.model_spec import ModelSpec

from runtime.schema.families import torchtitan_builder


def model_spec(family: str, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int | None, hidden_dim: int,
               vocab_size: int, rope_theta: float, norm_eps: float, max_seq_len: int, tie_embeddings: bool,
               head_dim: int | None = None, qk_norm: bool = True, rope_scaling: dict | None = None,
               attn_backend: str = "flex") -> ModelSpec:
    """torchtitan's ModelSpec (model config, parallelize and pipelining functions, HF state-dict adapter) of its
    model `family` at this shape. attn_backend is torchtitan's ("flex" or "varlen"): both take the per-document
    positions our dataloader gives (runtime/titan/data.py), which make one causal block per sample."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    builder = importlib.import_module(torchtitan_builder(family))
    config, parallelize_fn, adapter = builder.model_config(
        family, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads or n_heads, hidden_dim=hidden_dim,
        vocab_size=vocab_size, rope_theta=float(rope_theta), max_seq_len=max_seq_len,
        tie_embeddings=bool(tie_embeddings), head_dim=head_dim, qk_norm=qk_norm, rope_scaling=rope_scaling,
        attn_backend=attn_backend)
    # torchtitan's builders leave every norm at its default eps; the recipe's applies to all of them.
    for _, norm, _, _ in config.traverse(RMSNorm.Config):
        norm.eps = float(norm_eps)
    # flavor: no torchtitan flavor names this shape; the logs say "<name> custom".
    return ModelSpec(name=family, flavor="custom", model=config, parallelize_fn=parallelize_fn,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None, state_dict_adapter=adapter)


def vocab_size(tokenizer: str, multiple: int) -> int:
    """The model's vocabulary where the launch could not know it (the tokenizer is made by the launch's
    data_preparation, or lives on the cluster): the tokenizer's, padded up to `multiple` as our runtime pads it
    (a multiple of model.make_vocab_size_divisible_by)."""
    from runtime.schema.rules_model import padded_vocab_size
    from runtime.schema.training import tokenizer_vocab

    vocab = tokenizer_vocab(tokenizer, files="warn")[0]
    if vocab is None:
        raise ValueError(f"model.tokenizer: {tokenizer} gives no vocabulary; prepare the data first")
    return padded_vocab_size(vocab, multiple)
