# What every family module uses to read a Hugging Face config.json: required and optional keys with the defaults
# of transformers' config class, refusals that name the key, and RoPE's settings in either of the forms
# transformers writes (4.x: rope_theta + rope_scaling; 5.x: rope_parameters). Standard library only.
from __future__ import annotations

import dataclasses
from typing import Any

_REQUIRED = object()


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

    @property
    def rope_tables(self) -> int:
        return self.rotary_tables if self.rotary_tables is not None else int(self.rotary)


class HFConfig:
    """A config.json dict read for one model_type: every refusal is a ValueError naming the key."""

    def __init__(self, data: dict):
        self.data, self.model_type = data, data.get("model_type")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if self.data.get(key) is None:
            if default is _REQUIRED:
                raise ValueError(f"config.json has no {key!r}, which model_type={self.model_type!r} needs")
            return default
        return self.data[key]

    def count(self, key: str, default: Any = _REQUIRED) -> int:
        """A size: a positive integer (a JSON 4096.0 is read as 4096)."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
            raise ValueError(f"config.json {key}={value!r} must be a positive integer")
        return int(value)

    def require(self, key: str, supported: tuple, default: Any) -> None:
        """Refuse a value our model would compute differently; an absent key takes `default`."""
        value = self.data.get(key, default)
        if value not in supported:
            raise ValueError(f"config.json {key}={value!r} is not supported for model_type={self.model_type!r}; "
                             f"supported: {' or '.join(repr(v) for v in supported)}")

    def full_attention(self, positions: int) -> None:
        """Refuse a sliding window shorter than the context: our attention sees the whole sequence."""
        if self.data.get("use_sliding_window") is True:
            raise ValueError("config.json use_sliding_window=true is not supported: our attention sees the whole "
                             "sequence; supported: false")
        kinds = set(self.data.get("layer_types") or ()) - {"full_attention"}
        if kinds:
            raise ValueError(f"config.json layer_types holds {sorted(kinds)[0]!r}: our attention sees the whole "
                             "sequence in every layer; supported: full_attention only")
        window = self.data.get("sliding_window")
        if window is not None and self.data.get("use_sliding_window") is not False and int(window) < positions:
            raise ValueError(f"config.json sliding_window={window} is not supported: our attention sees the whole "
                             f"sequence; supported: null or at least max_position_embeddings ({positions})")

    def rope(self, default_theta: float) -> dict[str, Any]:
        """`rotary_base` and, when the config scales RoPE, `rope_scaling` (RopeScaling's fields)."""
        params = dict(self.data.get("rope_scaling") or {})
        params.update(self.data.get("rope_parameters") or {})
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        theta = float(params.pop("rope_theta", None) or self.get("rope_theta", default_theta))
        keys: dict[str, Any] = {"rotary_base": theta}
        allowed = {"default": set(), "linear": {"factor"},
                   "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
        if rope_type not in allowed:
            raise ValueError(f"config.json rope_type={rope_type!r} (rope_scaling / rope_parameters) is not "
                             f"supported; supported: {', '.join(allowed)}")
        extra = sorted(set(params) - allowed[rope_type])
        if extra:
            raise ValueError(f"config.json rope_scaling / rope_parameters key {extra[0]!r} is not supported with "
                             f"rope_type={rope_type!r}; supported keys: {sorted(allowed[rope_type] | {'rope_type'})}")
        missing = sorted(allowed[rope_type] - set(params))
        if missing:
            raise ValueError(f"config.json rope_scaling / rope_parameters has no {missing[0]!r}, which "
                             f"rope_type={rope_type!r} needs")
        if rope_type != "default":
            keys["rope_scaling"] = {"rope_type": rope_type, **{k: _number(v) for k, v in params.items()}}
        return keys


def _number(value: Any) -> float | int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else float(value)


def rope_export(cfg) -> dict[str, Any]:
    """The RoPE keys of an exported config.json, in transformers 4.x's form (which 5.x reads too)."""
    keys: dict[str, Any] = {"rope_theta": cfg.rotary_base}
    scaling = cfg.rope_scaling
    if scaling is not None:
        keys["rope_scaling"] = {"rope_type": scaling.rope_type, "factor": scaling.factor}
        if scaling.rope_type == "llama3":
            keys["rope_scaling"].update(low_freq_factor=scaling.low_freq_factor,
                                        high_freq_factor=scaling.high_freq_factor,
                                        original_max_position_embeddings=scaling.original_max_position_embeddings)
    return keys
