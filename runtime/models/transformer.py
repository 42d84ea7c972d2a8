# The decoder-only language model both architectures share: embeddings -> blocks -> final norm -> output head.
# gpt.py and llama.py only choose the parts; initialization lives here so it is one code path for both.
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from runtime.schema.model import ModelConfig
from runtime.models.init import Init
from runtime.models.layers import Block, SequenceLayout, TokenCrossEntropy, mask_padded_vocab
from runtime.models.moe import SparseMoE

# Linears that write into the residual stream get Megatron's scaled init, std / sqrt(2 * num_layers),
# so the residual's variance does not grow with depth.
_RESIDUAL_OUTPUT_NAMES = ("proj", "fc2", "down")


class Embeddings(nn.Module):
    """Token embeddings, times `scale` in their own dtype when given (sqrt(hidden) in some families), plus learned absolute
    positions for GPT, then dropout."""

    def __init__(self, vocab: int, hidden: int, *, max_positions: int | None, dropout: float,
                 scale: float | None = None):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.scale = scale
        self.position = nn.Embedding(max_positions, hidden) if max_positions else None
        self.dropout = nn.Dropout(dropout)
        # Seam for context parallelism: positions(T, device) of a rank's T tokens when they are not 0..T-1.
        self.positions = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.word(input_ids)  # (B, T, H)
        if self.scale is not None:
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        if self.position is not None:
            T = input_ids.shape[1]
            if positions is not None and positions.shape[1] != T and self.positions is not None:
                positions = positions[:, self.positions(T, input_ids.device)]  # the whole row's (context group)
            if positions is not None:  # a SequenceLayout's (B, T)
                h = h + self.position.weight[positions]
            elif self.positions is None:
                h = h + self.position.weight[:T]  # (T, H) broadcast over batch; no index gather
            else:
                h = h + self.position.weight[self.positions(T, input_ids.device)]
        return self.dropout(h)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, embed: Embeddings, layers: list[Block], final_norm: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Seams for tensor parallelism: identity / plain CE here, vocab-parallel versions after parallelize_model.
        self.gather_vocab = nn.Identity()
        self.loss_fn = TokenCrossEntropy(cfg.padding_from)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                layout: SequenceLayout | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V); with labels (B, T) -> per-token loss (B, T) in fp32.

        The loss path hands the logits straight to the loss (no gather over vocab shards, no shifted copy);
        callers apply their own mask and normalization. layout: packed examples or a KV cache (SequenceLayout).
        """
        h = self.embed(input_ids, None if layout is None else layout.positions)
        for layer in self.layers:
            h = layer(h) if layout is None else layer(h, layout)
        logits = self.output(self.final_norm(h))  # (B, T, V), or (B, T, V/tp) under tensor parallelism
        if labels is None:
            return mask_padded_vocab(self.gather_vocab(logits), self.cfg.padding_from)
        return self.loss_fn(logits, labels)

    def tie_weights(self) -> None:
        """Share the token embedding with the output head (GPT's share_embeddings_and_output_weights).

        Called again after anything that re-creates parameters (the allocation after the meta build,
        tensor-parallel slicing) since those break the sharing.
        """
        if self.cfg.share_embeddings_and_output_weights:
            self.output.weight = self.embed.word.weight

    def init_rules(self) -> dict[str, Init]:
        """How every parameter starts (runtime/models/init.py), by full name; read on the unsharded model (on the
        meta device or not). Linears and embeddings are normal(init_method_std), the residual-stream outputs
        normal(std / sqrt(2 * num_layers)), norms one, biases zero. A tied output head takes the embedding's
        values; a module with its own `init_rules(prefix)` (LoRA adapters) names its parameters' rules."""
        std = self.cfg.init_method_std
        scaled = Init("normal", std / math.sqrt(2.0 * self.cfg.num_layers))
        rules: dict[str, Init] = {}
        first: dict[int, str] = {}  # a parameter under two names takes its first name's values
        for name, param in self.named_parameters(remove_duplicate=False):
            first.setdefault(id(param), name)
        for prefix, module in self.named_modules():
            local: dict[str, Init] = {}
            if hasattr(module, "init_rules") and module is not self:
                rules.update(module.init_rules(prefix))
                continue
            if isinstance(module, nn.Linear):
                local["weight"] = scaled if prefix.endswith(_RESIDUAL_OUTPUT_NAMES) else Init("normal", std)
                local["bias"] = Init("zeros")
            elif isinstance(module, nn.Embedding):
                local["weight"] = Init("normal", std)
            elif isinstance(module, SparseMoE):  # its router is an nn.Linear, named as a child module
                local["gate_up"], local["down"] = Init("normal", std), scaled
            elif getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                local["weight"], local["bias"] = Init("ones"), Init("zeros")  # LayerNorm / RMSNorm
            for key, init in local.items():
                param = module._parameters.get(key)
                if param is not None:
                    name = f"{prefix}.{key}" if prefix else key
                    owner = first[id(param)]
                    rules[name] = init if owner == name else dataclasses.replace(rules[owner], name=owner)
        return rules

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
