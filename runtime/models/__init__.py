# Plain PyTorch language models. Nothing here imports torch.distributed: runtime/parallel applies parallelism
# to these modules afterwards (habit 1 of the style guide), so a model reads top to bottom like a single-GPU one.
from __future__ import annotations

import torch

from runtime.schema.model import ModelConfig, padded_vocab_size
from runtime.models.gpt import GPTModel
from runtime.models.llama import LlamaModel
from runtime.models.transformer import CausalLM

_MODELS = {"gpt": GPTModel, "llama": LlamaModel}


def build_model(cfg: ModelConfig) -> CausalLM:
    """The full model in fp32 on CPU, initialized from cfg (including cfg.seed) and nothing else."""
    # Build on the meta device and initialize once: nn.Linear's own init would draw from the global RNG and,
    # for billion-parameter models, cost as much time as ours.
    with torch.device("meta"):
        model = _MODELS[cfg.architecture](cfg)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own storage
    model.init_weights()
    return model


__all__ = ["CausalLM", "ModelConfig", "build_model", "padded_vocab_size"]
