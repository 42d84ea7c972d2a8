# What every family module uses to read a Hugging Face config.json: required and optional keys with the defaults
# of transformers' config class, refusals that name the key, and RoPE's settings in either of the forms
# transformers writes (4.x: rope_theta + rope_scaling; 5.x: rope_parameters). Standard library only.
from __future__ import annotations

from typing import Any

_REQUIRED = object()


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

    def refuse_quantized(self, family: str, fix: str) -> None:
        """Refuse quantized weights (config.json quantization_config); `fix`: how to get a bf16 or fp32 copy."""
        quantization = self.data.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ValueError(f"config.json quantization_config (quant_method {method!r}): quantized {family} weights "
                             f"are not read here; give a bf16 or fp32 copy ({fix})")

    def rope(self, default_theta: float) -> dict[str, Any]:
        """`rotary_base` and, when the config scales RoPE, `rope_scaling` (RopeScaling's fields)."""
        params = dict(self.data.get("rope_scaling") or {})
        params.update(self.data.get("rope_parameters") or {})
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        theta = float(params.pop("rope_theta", None) or self.get("rope_theta", default_theta))
        keys: dict[str, Any] = {"rotary_base": theta}
        required = {"default": set(), "linear": {"factor"},
                    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
                    "yarn": {"factor"}}
        # transformers' defaults for what a config.json may leave out (yarn: its standardize_rope_params and
        # _compute_yarn_parameters; `or` as theirs: a null beta is the default too).
        optional = {"yarn": {"original_max_position_embeddings": self.data.get("max_position_embeddings"),
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
                             "attention_factor": None, "truncate": True}}
        if rope_type not in required:
            raise ValueError(f"config.json rope_type={rope_type!r} (rope_scaling / rope_parameters) is not "
                             f"supported; supported: {', '.join(required)}")
        defaults = optional.get(rope_type, {})
        allowed = required[rope_type] | set(defaults)
        extra = sorted(set(params) - allowed)
        if extra:
            raise ValueError(f"config.json rope_scaling / rope_parameters key {extra[0]!r} is not supported with "
                             f"rope_type={rope_type!r}; supported keys: {sorted(allowed | {'rope_type'})}")
        missing = sorted(required[rope_type] - {k for k, v in params.items() if v is not None})
        if missing:
            raise ValueError(f"config.json rope_scaling / rope_parameters has no {missing[0]!r}, which "
                             f"rope_type={rope_type!r} needs")
        for key, default in defaults.items():
            if params.get(key) is None or (key.startswith("beta") and not params[key]):
                params[key] = default
        if rope_type == "yarn" and params["original_max_position_embeddings"] is None:
            raise ValueError("config.json has no 'max_position_embeddings' nor rope_scaling / rope_parameters "
                             "'original_max_position_embeddings', which rope_type='yarn' needs")
        if rope_type != "default":
            keys["rope_scaling"] = {"rope_type": rope_type, **{k: _number(v) for k, v in params.items()}}
        return keys


def _number(value: Any) -> float | int | bool | None:
    if value is None or isinstance(value, bool):
        return value
    return int(value) if isinstance(value, int) else float(value)


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
        if scaling.rope_type == "yarn":
            keys["rope_scaling"].update(original_max_position_embeddings=scaling.original_max_position_embeddings,
                                        beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
                                        truncate=scaling.truncate)
            keys["rope_scaling"].update({key: getattr(scaling, key) for key in ("mscale", "mscale_all_dim",
                                                                                  "attention_factor")
                                         if getattr(scaling, key) is not None})
    return keys
