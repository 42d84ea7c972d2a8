# Plain PyTorch language models. Nothing here imports torch.distributed: runtime/parallel applies parallelism
# to these modules afterwards (habit 1 of the style guide), so a model reads top to bottom like a single-GPU one.
from __future__ import annotations

import importlib

import torch
from torch.overrides import TorchFunctionMode

from runtime.schema.families import architecture
from runtime.schema.model import ModelConfig, padded_vocab_size
from runtime.models.init import materialize
from runtime.models.transformer import CausalLM


class SkipFillsOnMeta(TorchFunctionMode):
    """Skips the in-place fills that module constructors run on their new parameters while those live on the meta
    device. They hold no values to fill, and PyTorch's meta kernel for a random fill (normal_) is a Python
    reference whose first call imports torch._dynamo: 2-10 s in every training process, for nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


# torch.nn.init's functions and the Tensor methods they end in; each returns its tensor.
_FILLS = {"normal_", "uniform_", "fill_", "zero_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "trunc_normal_", "ones_", "zeros_", "constant_"}


def meta_model(cfg: ModelConfig) -> CausalLM:
    """The model with every parameter on the meta device: shapes and names, no memory, no initialization."""
    model_class = network_class(cfg.architecture)  # imported outside the meta device: module-level tensors are real
    with torch.device("meta"), SkipFillsOnMeta():
        return model_class(cfg)


def network_class(name: str) -> type[CausalLM]:
    """The CausalLM class of a model.architecture, as its registry entry names it (runtime/schema/families)."""
    module, attribute = architecture(name).network.split(":")
    return getattr(importlib.import_module(module), attribute)


def build_model(cfg: ModelConfig) -> CausalLM:
    """The full model in fp32 on CPU, with the values cfg (and cfg.seed) define for it (runtime/models/init.py):
    exactly the values every sharded layout materializes for its own part."""
    model = meta_model(cfg)
    materialize(model, model.init_rules(), cfg.seed)
    return model


__all__ = ["CausalLM", "ModelConfig", "SkipFillsOnMeta", "build_model", "materialize", "meta_model",
           "network_class", "padded_vocab_size"]
