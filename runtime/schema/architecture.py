# What a `model.architecture` network is made of, as the code outside the families asks it: the registry's entry
# type (runtime/schema/families lists every one in ARCHITECTURES; a folder family, runtime/families/<name>, declares
# its own). Its own module, outside the families package, so a family can declare its entry while the registry is
# importing it. Standard library only.
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a `model.architecture` network is made of, as the code outside the families asks it (the estimator, the
    rules, the metrics, the config importers): a question is a field here, never a branch on the architecture's
    name. runtime/schema/families lists every one (ARCHITECTURES); a folder family declares its own."""

    name: str
    network: str             # "module:attribute" of its CausalLM class (torch; runtime/models builds it)
    weights: str             # the module whose weight_rules(cfg, Rule) name its tensors as Hugging Face does
    gated_mlp: bool          # gate and up projections (SwiGLU, GeGLU: three h x ffn matrices) rather than one fc1
    rotary: bool             # RoPE on q and k; otherwise a learned position table beside the token embedding
    biases: bool             # every linear and norm carries a bias
    rms_norm: bool           # RMSNorm (run in fp32 on an upcast copy); otherwise LayerNorm
    embedding_dropout: bool  # model.hidden_dropout also drops out of the embeddings
    tied_default: bool       # share_embeddings_and_output_weights when the YAML leaves it out
    switches: tuple[str, ...] = ()  # ModelConfig keys it computes beyond the common shape (rules.MODEL_SWITCHES)
    moe: bool = False        # model.moe's sparse layers (SwiGLU experts) can replace its MLPs
    qk_norm: bool = False    # per-head q/k norms always (otherwise as model.qk_layernorm says)
    norms_per_layer: int = 2  # a sandwich: 4 (input, post-attention, pre- and post-feedforward)
    rotary_tables: int | None = None  # RoPE cos/sin table pairs a device holds (None: one when rotary)
    # NeMo / NxD megatron files name a network by (normalization, position_embedding_type, activation, bias).
    megatron: tuple[tuple[str, str, str, bool], ...] = ()
    tiny_recipe: str | None = None  # the smallest training recipe of this network, which imported configs sit on
    sizes: str | None = None        # the published shape series autoconfig's model-size ladder follows
    # What runtime/schema/sizes.py counts (parameters, FLOPs, the estimator's activations) beyond the common shape:
    attention_biases: bool = False  # biases on q, k, v and the output projection
    attention_sinks: bool = False   # a learned sink logit per head (CoreAttention then spells its scores out)
    expert_biases: bool = False     # the router's bias (E) and each expert's gate_up (2F) and down (H) biases
    arithmetic: str | None = None   # a torch-free module whose attention(shape, tp) counts an attention of its own

    @property
    def rope_tables(self) -> int:
        return self.rotary_tables if self.rotary_tables is not None else int(self.rotary)
