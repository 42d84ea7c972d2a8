# The model's half of the training config: the Seam 2 `model:` keys that decide the network's shape and init.
# Parallel layout keys (tensor_model_parallel_size, ...) are deliberately absent: the model never depends on them.
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

ARCHITECTURES = ("gpt", "llama")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Round the tokenizer's vocabulary up to a multiple of `make_vocab_size_divisible_by`.

    Padding depends only on these two numbers, never on the tensor-parallel size, so the embedding shape (and
    therefore the initialization) is the same whatever the layout; validation separately requires tp to divide it.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if divisible_by <= 0:
        raise ValueError(f"model.make_vocab_size_divisible_by must be positive, got {divisible_by}")
    return math.ceil(vocab_size / divisible_by) * divisible_by


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str                  # gpt | llama
    vocab_size: int                    # already padded (see padded_vocab_size)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    num_query_groups: int | None = None    # GQA key/value heads; None = num_attention_heads (plain MHA)
    rotary_base: float = 10000.0           # llama only
    share_embeddings_and_output_weights: bool = False
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model.architecture={self.architecture!r} is not one of {list(ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                    "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"model.num_query_groups={self.num_query_groups}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"model.{key} must be in [0, 1), got {getattr(self, key)}")

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_model_section(cls, model: Mapping[str, Any], tokenizer_vocab_size: int) -> "ModelConfig":
        """Build from the resolved `model:` subtree of the training config (Seam 2) and the tokenizer's size."""
        divisible_by = int(model.get("make_vocab_size_divisible_by", 128))
        optional = {f.name for f in dataclasses.fields(cls)} - {"architecture", "vocab_size"}
        kwargs = {key: model[key] for key in optional if model.get(key) is not None}
        return cls(architecture=model["architecture"],
                   vocab_size=padded_vocab_size(tokenizer_vocab_size, divisible_by), **kwargs)
