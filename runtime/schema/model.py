# The model's half of a stage config: the `model:` keys that decide the network's shape and init, the
# tokenizer's vocabulary size, and the mapping from a Hugging Face config.json (`model.model_config`, as
# NxD Training points at one, and the conversion stage's import). Standard library only.
# Parallel layout keys (tensor_model_parallel_size, ...) are deliberately absent: the model never depends on them.
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Mapping

from runtime.schema import rules
from runtime.schema.choices import ARCHITECTURES
from runtime.schema.reader import ConfigErrors, Report
from runtime.schema.rules import padded_vocab_size

# The config.json model types our models compute exactly (runtime/convert/hf.py maps their weights).
# mistral: Llama's layers and weight names (MistralForCausalLM), accepted without a sliding window.
HF_MODEL_TYPES = ("gpt2", "llama", "mistral", "mixtral")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """`model.moe`, with NxD Training's key names: a sparse MoE block (runtime/models/moe.py) in place of the MLP
    of every `frequency`-th layer, starting with the first (Megatron's moe_layer_freq; Mixtral: 1, every layer)."""
    num_experts: int
    top_k: int = 2
    frequency: int = 1
    capacity_factor: float | None = None    # None: dropless, every token reaches its top_k experts
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    normalize_top_k_affinities: bool = True
    router_activation: str = "softmax"      # softmax | sigmoid

    def is_moe_layer(self, index: int) -> bool:
        return index % self.frequency == 0


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
    moe: MoEConfig | None = None           # llama only: Mixtral-style sparse MoE layers

    def __post_init__(self) -> None:
        # The same rules the stage parsers run, for models built in code (tests, benchmarks, conversion).
        report = Report()
        report.error(ARCHITECTURES.problem("model.architecture", self.architecture))
        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                    "max_position_embeddings"):
            if getattr(self, key) <= 0:
                report.error(f"model.{key}: {getattr(self, key)} must be a positive integer")
        report.raise_if_any()
        report.error(rules.hidden_heads(self.hidden_size, self.num_attention_heads, ""))
        report.error(rules.heads_groups(self.num_attention_heads, self.kv_heads, ""))
        for key in ("hidden_dropout", "attention_dropout"):
            report.error(rules.dropout(key, getattr(self, key), ""))
        if self.moe is not None:
            for problem in rules.moe(self.architecture, self.moe.num_experts, self.moe.top_k, self.moe.frequency,
                                     self.num_layers, self.moe.capacity_factor, self.moe.router_activation, ""):
                report.error(problem)
        report.raise_if_any()

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_model_section(cls, model: Mapping[str, Any], tokenizer_vocab_size: int) -> "ModelConfig":
        """From typed `model:` keys (the stage parsers' output) and the tokenizer's size, padded here."""
        divisible_by = int(model.get("make_vocab_size_divisible_by", 128))
        optional = {f.name for f in dataclasses.fields(cls)} - {"architecture", "vocab_size"}
        kwargs = {key: model[key] for key in optional if model.get(key) is not None}
        if isinstance(kwargs.get("moe"), Mapping):  # model.moe as YAML holds it (hf_model_keys' import)
            kwargs["moe"] = MoEConfig(**kwargs["moe"])
        return cls(architecture=model["architecture"],
                   vocab_size=padded_vocab_size(tokenizer_vocab_size, divisible_by), **kwargs)


def tokenizer_vocab_size(path: str | Path) -> int:
    """Vocabulary size of a Hugging Face tokenizer.json, added tokens included, read as JSON (no tokenizers
    import, so the launcher can check vocabulary padding): the largest token id + 1. ValueError names the file."""
    try:
        stat = os.stat(path)
    except OSError:
        return _read_vocab_size(path, str(path))  # names what is wrong with it
    # A launch asks several times (schema, padding check, estimator) and Llama 3's file takes ~0.15 s to parse:
    # read once per file version (path, size and modification time).
    return _cached_vocab_size(os.path.realpath(path), stat.st_size, stat.st_mtime_ns, str(path))


@functools.lru_cache(maxsize=64)
def _cached_vocab_size(real_path: str, size: int, mtime_ns: int, shown: str) -> int:
    return _read_vocab_size(real_path, shown)


def _read_vocab_size(path: str | Path, shown: str) -> int:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # BPE dict / Unigram list
        ids += [token["id"] for token in data.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except FileNotFoundError:
        raise ValueError(f"{shown!r} does not exist (expected a tokenizer.json)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{shown!r} is not a readable tokenizer.json") from None


def read_hf_config(path: str | Path) -> dict:
    """A Hugging Face config.json (or the directory holding one) as a dict; ValueError names the file."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{str(file)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(file)!r} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} does not hold a JSON object")
    return data


_REQUIRED = object()


def hf_model_keys(hf_config: dict, tokenizer_vocab_size: int | None = None) -> dict[str, Any]:
    """config.json -> our `model:` keys, refusing what our models do not compute the same way (ValueError)."""
    model_type = hf_config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {list(HF_MODEL_TYPES)}")

    def get(key: str, default: Any = _REQUIRED) -> Any:
        if hf_config.get(key) is None:
            if default is _REQUIRED:
                raise ValueError(f"config.json has no {key!r}, which model_type={model_type!r} needs")
            return default
        return hf_config[key]

    vocab = int(get("vocab_size"))
    if model_type == "gpt2":
        _require(hf_config, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
        _require(hf_config, "scale_attn_weights", (True,), True)
        _require(hf_config, "scale_attn_by_inverse_layer_idx", (False,), False)
        _require(hf_config, "add_cross_attention", (False,), False)
        hidden, positions = int(get("n_embd")), int(get("n_positions"))
        keys = {"architecture": "gpt", "hidden_size": hidden, "num_layers": int(get("n_layer")),
                "num_attention_heads": int(get("n_head")), "num_query_groups": None,
                "ffn_hidden_size": int(get("n_inner", None) or 4 * hidden),
                "layernorm_epsilon": float(get("layer_norm_epsilon", 1e-5))}
    else:
        _require(hf_config, "hidden_act", ("silu",), "silu")
        _require(hf_config, "attention_bias", (False,), False)
        _require(hf_config, "mlp_bias", (False,), False)
        _require(hf_config, "rope_scaling", (None,), None)
        rope = get("rope_parameters", None) or {}
        if set(rope) - {"rope_theta", "rope_type"} or rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_parameters={rope!r} is not supported; supported: plain RoPE "
                             "({'rope_type': 'default', 'rope_theta': ...}), no scaling")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        positions = int(get("max_position_embeddings"))
        _require(hf_config, "head_dim", (None, hidden // heads), None)
        # Absent keys take the defaults of transformers' config class for this model_type, as its loader does.
        theta, eps = (1e6, 1e-5) if model_type == "mixtral" else (10000.0, 1e-6)
        keys = {"architecture": "llama", "hidden_size": hidden, "num_layers": int(get("num_hidden_layers")),
                "num_attention_heads": heads, "num_query_groups": int(get("num_key_value_heads", None) or heads),
                "ffn_hidden_size": int(get("intermediate_size")), "layernorm_epsilon": float(get("rms_norm_eps", eps)),
                "rotary_base": float(rope.get("rope_theta", get("rope_theta", theta)))}
        if model_type == "mixtral":
            keys["moe"] = _mixtral_moe(hf_config, get, positions)
        if model_type == "mistral":
            _full_attention(hf_config, positions)
    keys.update({"max_position_embeddings": positions, "encoder_seq_length": positions,
                 "share_embeddings_and_output_weights": bool(get("tie_word_embeddings", model_type == "gpt2")),
                 "make_vocab_size_divisible_by": vocab_divisor(vocab, tokenizer_vocab_size)})
    return keys


def _mixtral_moe(hf_config: dict, get: Any, positions: int) -> dict[str, Any]:
    """Mixtral's MoE keys -> `model.moe` as the stage YAML holds it (MoEConfig's fields; the parsers type it).
    Mixtral's router is a softmax over all experts, top_k renormalized, dropless, in every layer."""
    _full_attention(hf_config, positions)
    _require(hf_config, "router_jitter_noise", (0.0,), 0.0)  # training-time input noise our router does not add
    # transformers adds router_aux_loss_coef * the load-balancing loss only with output_router_logits; the
    # coefficient is still the model's recipe, so training here uses it (computed per layer, see models/moe.py).
    return {"num_experts": int(get("num_local_experts")), "top_k": int(get("num_experts_per_tok", 2)),
            "frequency": 1, "capacity_factor": None,
            "router_aux_loss_coef": float(get("router_aux_loss_coef", 0.001)), "router_z_loss_coef": 0.0,
            "normalize_top_k_affinities": True, "router_activation": "softmax"}


def _full_attention(hf_config: dict, positions: int) -> None:
    window = hf_config.get("sliding_window")
    if window is not None and int(window) < positions:
        raise ValueError(f"config.json sliding_window={window} is not supported: our attention sees the whole "
                         f"sequence; supported: null or at least max_position_embeddings ({positions})")


def _require(hf_config: dict, key: str, supported: tuple, default: Any) -> None:
    value = hf_config.get(key, default)
    if value not in supported:
        raise ValueError(f"config.json {key}={value!r} is not supported; supported: "
                         f"{' or '.join(repr(v) for v in supported)}")


def vocab_divisor(vocab: int, tokenizer_vocab: int | None) -> int:
    """A make_vocab_size_divisible_by that pads the tokenizer's size to exactly `vocab`, a power of two if one
    does (e.g. 128 for 50304 and GPT-2's 50257 tokens); HF's own vocab_size always does."""
    if tokenizer_vocab is None:
        return vocab
    if problem := rules.tokenizer_fits(tokenizer_vocab, vocab, ""):
        raise ValueError(problem)
    power = vocab & -vocab  # the largest power of two dividing vocab
    return power if vocab - tokenizer_vocab < power else vocab


__all__ = ["ConfigErrors", "HF_MODEL_TYPES", "MoEConfig", "ModelConfig", "hf_model_keys", "padded_vocab_size",
           "read_hf_config", "tokenizer_vocab_size", "vocab_divisor"]
