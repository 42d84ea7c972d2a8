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
from runtime.schema.choices import ARCHITECTURES, ROPE_SCALING_TYPES
from runtime.schema.families import HF_MODEL_TYPES, architecture, import_keys
from runtime.schema.reader import ConfigErrors, Report
from runtime.schema.rules import padded_vocab_size


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """`model.moe`, with NxD Training's key names: a sparse MoE block (runtime/models/moe.py) in place of the MLP
    of every `frequency`-th layer, starting with the first (Megatron's moe_layer_freq; Mixtral: 1, every layer),
    or of the layers `layers` lists (Qwen3-MoE's decoder_sparse_step and mlp_only_layers)."""
    num_experts: int
    top_k: int = 2
    frequency: int = 1
    capacity_factor: float | None = None    # None: dropless, every token reaches its top_k experts
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    normalize_top_k_affinities: bool = True
    router_activation: str = "softmax"      # softmax | sigmoid
    ffn_hidden_size: int | None = None      # each expert's; None: model.ffn_hidden_size (Qwen3-MoE's is its own)
    layers: tuple[int, ...] | None = None   # the MoE layers by index; None: every frequency-th
    # DeepSeek-V3's router and shared experts: a learned per-expert bias added to
    # the scores for choosing only (aux-loss-free balancing), the experts in `groups` of which each token's best
    # `top_groups` (by their two best scores) are eligible, the chosen weights times `routed_scaling_factor`, and
    # a dense SwiGLU of shared_ffn_hidden_size beside the experts that every token goes through.
    score_bias: bool = False
    groups: int = 1
    top_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_ffn_hidden_size: int | None = None
    # DeepSeek-V3's auxiliary-loss-free balancing (Megatron-core's moe_router_bias_update_rate, with
    # moe_router_enable_expert_bias as score_bias): after each optimizer step every selection bias moves by this
    # much towards its layer's mean load over the global batch (runtime/models/moe.py bias_update). 0.0: the bias
    # stays as loaded (a fine-tuning's default; DeepSeek-V3's pretraining used 0.001, then 0.0 for its last tokens).
    router_bias_update_rate: float = 0.0

    def expert_size(self, dense_ffn: int) -> int:
        """Each expert's FFN size: its own, or the dense MLP's (model.ffn_hidden_size: Mixtral)."""
        return self.ffn_hidden_size or dense_ffn

    def is_moe_layer(self, index: int) -> bool:
        return index in self.layers if self.layers is not None else index % self.frequency == 0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """`model.rope_scaling`, with Hugging Face's keys (config.json's rope_scaling / rope_parameters): how RoPE's
    frequencies are stretched for a context longer than the one the model was pretrained at.

    llama3 (Llama 3.1-3.3): wavelengths longer than original_max / low_freq_factor are divided by `factor`,
    shorter than original_max / high_freq_factor kept, and those in between blended smoothly.
    linear (position interpolation): every frequency divided by `factor`.
    yarn (GPT-OSS, DeepSeek-V3): frequencies blended between divided by `factor` and kept, by a linear ramp over
    the dims that turn between beta_slow and beta_fast times in the original context; cos and sin scaled by the
    attention factor (attention_factor, or 0.1 ln(factor) + 1, or DeepSeek's mscale / mscale_all_dim ratio)."""

    rope_type: str                                  # llama3 | linear | yarn (choices.ROPE_SCALING_TYPES)
    factor: float
    low_freq_factor: float = 1.0                    # llama3 only
    high_freq_factor: float = 4.0                   # llama3 only
    original_max_position_embeddings: int = 8192    # llama3 and yarn
    beta_fast: float = 32.0                         # yarn only, from here on
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """`model.latent_attention`: multi-head latent attention (DeepSeek-V2/V3), with
    Hugging Face's keys. Queries through a rank-q_lora_rank bottleneck (None: one q projection), keys and values
    from one rank-kv_lora_rank latent plus a qk_rope_head_dim key shared by the heads; each head's q/k are
    qk_nope_head_dim unrotated + qk_rope_head_dim rotated channels, its values v_head_dim."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str                  # gpt | llama | a folder family's (runtime/families/<name>)
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
    ffn_dropout: float = 0.0               # inside the MLP, after its activation (Megatron's; NxD's megatron models)
    seed: int = 1234
    moe: MoEConfig | None = None           # llama only: Mixtral-style sparse MoE layers
    # Megatron's names. kv_channels: the head size when it is not hidden_size / num_attention_heads (Qwen3).
    kv_channels: int | None = None
    add_qkv_bias: bool = False             # llama only: biases on q, k and v, none on the output (Qwen2)
    qk_layernorm: bool = False             # llama only: RMSNorm over each query and key head before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None  # llama only
    # A source model's own vocab_size (its config.json's) when vocab_size pads it: the rows from it on are ours
    # alone, zero when loaded, their logits masked out of every softmax (-inf), and dropped on export. None: every
    # row is the model's (pretraining: Megatron's padding, whose rows train like any other).
    unpadded_vocab_size: int | None = None
    # Attention by layer (Hugging Face's layer_types): "sliding_attention" sees the sliding_window positions up to
    # its own, "full_attention" the whole sequence; None: every layer full. Keys of the folder families that
    # declare them (runtime/families, ARCHITECTURE.switches).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rotary_base: float | None = None  # RoPE base of the sliding-window layers, unscaled
    softmax_scale: float | None = None      # attention's softmax scale; None: 1 / sqrt(head_dim)
    latent_attention: LatentAttention | None = None

    def __post_init__(self) -> None:
        # The same rules the stage parsers run, for models built in code (tests, benchmarks, conversion).
        report = Report()
        report.error(ARCHITECTURES.problem("model.architecture", self.architecture))
        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                    "max_position_embeddings"):
            if getattr(self, key) <= 0:
                report.error(f"model.{key}: {getattr(self, key)} must be a positive integer")
        report.raise_if_any()
        report.error(rules.unpadded_vocab(self.unpadded_vocab_size, self.vocab_size))
        report.error(rules.head_size(self.hidden_size, self.num_attention_heads, self.kv_channels, ""))
        switches = {key: getattr(self, key) for key in rules.MODEL_SWITCHES}
        problems = rules.llama_switches(self.architecture, switches, "")
        problems.append(rules.attention_layers(self.layer_types, self.sliding_window, self.num_layers, ""))
        if self.rope_scaling is not None:
            problems += [ROPE_SCALING_TYPES.problem("model.rope_scaling.rope_type", self.rope_scaling.rope_type)]
            problems += rules.rope_scaling(self.rope_scaling, "model.rope_scaling")
        for problem in problems:
            report.error(problem)
        report.error(rules.heads_groups(self.num_attention_heads, self.kv_heads, ""))
        for key in rules.DROPOUTS:
            report.error(rules.dropout(key, getattr(self, key), ""))
        if self.moe is not None:
            for problem in rules.moe(self.architecture, self.moe.num_experts, self.moe.top_k, self.moe.frequency,
                                     self.num_layers, self.moe.capacity_factor, self.moe.router_activation, "",
                                     layers=self.moe.layers, ffn=self.moe.ffn_hidden_size,
                                     ffn_dropout=self.ffn_dropout, groups=(self.moe.groups, self.moe.top_groups)):
                report.error(problem)
            report.error(rules.bias_update(self.moe.router_bias_update_rate, self.moe.score_bias, ""))
        report.raise_if_any()

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def real_vocab_size(self) -> int:
        """The rows that are tokens of the model: the source's vocab_size, else every row."""
        return self.unpadded_vocab_size or self.vocab_size

    @property
    def padding_from(self) -> int | None:
        """The first row past the source's vocabulary when there are such rows (their logits are masked, export
        drops them), else None."""
        return self.unpadded_vocab_size if self.real_vocab_size < self.vocab_size else None

    def unpadded(self) -> "ModelConfig":
        """This model as its source holds it: vocab_size rows, no padding (what load and export convert from and to)."""
        return dataclasses.replace(self, vocab_size=self.real_vocab_size, unpadded_vocab_size=None)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def gated_mlp(self) -> bool:
        """The MLP is gated ([gate | up] then down), as the architecture's registry entry says."""
        return architecture(self.architecture).gated_mlp

    def attention_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window, or None when it attends to the whole sequence."""
        sliding = self.layer_types is not None and self.layer_types[index] == "sliding_attention"
        return self.sliding_window if sliding else None

    def fused_segments(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Our fused projections (by module path within a block) -> their output rows in order, each part by its
        Hugging Face name: the one statement of the [q | k | v] and [gate | up] layouts, which tensor parallelism's
        row shards, LoRA's segments and the HF conversion read. A sparse MoE layer's experts are not listed."""
        d, f = self.head_dim, self.ffn_hidden_size
        segments = {"attn.qkv": (("q_proj", self.num_attention_heads * d), ("k_proj", self.kv_heads * d),
                                 ("v_proj", self.kv_heads * d))}
        if self.gated_mlp:
            segments["mlp.gate_up"] = (("gate_proj", f), ("up_proj", f))
        return segments

    @classmethod
    def from_model_section(cls, model: Mapping[str, Any], tokenizer_vocab_size: int) -> "ModelConfig":
        """From typed `model:` keys (the stage parsers' output) and the tokenizer's size, padded here."""
        divisible_by = int(model.get("make_vocab_size_divisible_by", 128))
        optional = {f.name for f in dataclasses.fields(cls)} - {"architecture", "vocab_size"}
        kwargs = {key: model[key] for key in optional if model.get(key) is not None}
        if isinstance(kwargs.get("moe"), Mapping):  # model.moe as YAML holds it (hf_model_keys' import)
            moe = dict(kwargs["moe"])
            if moe.get("layers") is not None:
                moe["layers"] = tuple(moe["layers"])
            kwargs["moe"] = MoEConfig(**moe)
        if kwargs.get("layer_types") is not None:
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        if isinstance(kwargs.get("latent_attention"), Mapping):
            kwargs["latent_attention"] = LatentAttention(**kwargs["latent_attention"])
        if isinstance(kwargs.get("rope_scaling"), Mapping):
            kwargs["rope_scaling"] = RopeScaling(**kwargs["rope_scaling"])
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


def hf_model_keys(hf_config: dict, tokenizer_vocab_size: int | None = None) -> dict[str, Any]:
    """config.json -> our `model:` keys, by its family (runtime/schema/families), refusing what our models do not
    compute the same way (ValueError naming the key)."""
    keys, tied_default = import_keys(hf_config)
    vocab = hf_config.get("vocab_size")
    if vocab is None:
        raise ValueError(f"config.json has no 'vocab_size', which model_type={hf_config.get('model_type')!r} needs")
    tied = hf_config.get("tie_word_embeddings")
    keys.update({"encoder_seq_length": keys["max_position_embeddings"],
                 "share_embeddings_and_output_weights": bool(tied_default if tied is None else tied),
                 "make_vocab_size_divisible_by": vocab_divisor(int(vocab), tokenizer_vocab_size)})
    return keys


def vocab_divisor(vocab: int, tokenizer_vocab: int | None) -> int:
    """A make_vocab_size_divisible_by that pads the tokenizer's size to exactly `vocab`, a power of two if one
    does (e.g. 128 for 50304 and GPT-2's 50257 tokens); HF's own vocab_size always does."""
    if tokenizer_vocab is None:
        return vocab
    if problem := rules.tokenizer_fits(tokenizer_vocab, vocab, ""):
        raise ValueError(problem)
    power = vocab & -vocab  # the largest power of two dividing vocab
    return power if vocab - tokenizer_vocab < power else vocab


__all__ = ["ConfigErrors", "HF_MODEL_TYPES", "MoEConfig", "ModelConfig", "RopeScaling", "hf_model_keys",
           "padded_vocab_size", "read_hf_config", "tokenizer_vocab_size", "vocab_divisor"]
