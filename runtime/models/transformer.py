# The decoder-only language model both architectures share: embeddings -> blocks -> final norm -> output head.
# gpt.py and llama.py only choose the parts; initialization lives here so it is one code path for both.
from __future__ import annotations

import math

import torch
from torch import nn

from runtime.schema.model import ModelConfig
from runtime.models.layers import Block, RotaryEmbedding, SequenceLayout, TokenCrossEntropy
from runtime.models.moe import SparseMoE

# Linears that write into the residual stream get Megatron's scaled init, std / sqrt(2 * num_layers),
# so the residual's variance does not grow with depth.
_RESIDUAL_OUTPUT_NAMES = ("proj", "fc2", "down")


class Embeddings(nn.Module):
    """Token embeddings, plus learned absolute positions for GPT, then dropout."""

    def __init__(self, vocab: int, hidden: int, *, max_positions: int | None, dropout: float):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden) if max_positions else None
        self.dropout = nn.Dropout(dropout)
        # Seam for context parallelism: positions(T, device) of a rank's T tokens when they are not 0..T-1.
        self.positions = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.word(input_ids)  # (B, T, H)
        if self.position is not None:
            T = input_ids.shape[1]
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
        self.loss_fn = TokenCrossEntropy()

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
            return self.gather_vocab(logits)
        return self.loss_fn(logits, labels)

    def tie_weights(self) -> None:
        """Share the token embedding with the output head (GPT's share_embeddings_and_output_weights).

        Called again after anything that re-creates parameters (the allocation after the meta build,
        tensor-parallel slicing) since those break the sharing.
        """
        if self.cfg.share_embeddings_and_output_weights:
            self.output.weight = self.embed.word.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter from cfg.seed alone, in module order, on a private generator.

        The full (unsharded) model is always initialized first and parallelism slices it afterwards, so the
        weights are identical whatever the tp/pp/dp layout; the global RNG is left untouched.
        """
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.seed)
        std = self.cfg.init_method_std
        scaled_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        done: set[int] = set()  # a tied weight is initialized once, by the embedding that comes first

        def normal_(param: torch.Tensor, sigma: float) -> None:
            if id(param) not in done:
                done.add(id(param))
                # Draw on CPU in fp32 then copy, so the values do not depend on the target device or dtype.
                param.copy_(torch.empty(param.shape).normal_(0.0, sigma, generator=gen))

        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                normal_(module.weight, scaled_std if name.endswith(_RESIDUAL_OUTPUT_NAMES) else std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                normal_(module.weight, std)
            elif isinstance(module, RotaryEmbedding):
                module.reset_parameters()
            elif isinstance(module, SparseMoE):  # its router is an nn.Linear, drawn next as a child module
                normal_(module.gate_up, std)
                normal_(module.down, scaled_std)
            elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                module.weight.fill_(1.0)  # LayerNorm / RMSNorm
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
