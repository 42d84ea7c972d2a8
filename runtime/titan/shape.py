# What torchtitan's model is for one of our models, torch-free (the launcher builds the generated module's context
# from it; checkpoint conversion builds torchtitan's model from it): which torchtitan model (the family folder's
# TORCHTITAN, through the registry), why not where torchtitan has none that computes what ours does, and the shape
# as runtime/titan/model.py's model_spec takes it.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.schema.families import TORCHTITAN_MODELS, torchtitan_model
from runtime.schema.model import ModelConfig

# What our decoder can hold and torchtitan's Llama 3 and dense Qwen3 cannot: the model key, and whether the model
# asks for it (a config.json sets these as well as the YAML). Why each has no counterpart: launcher/titan_keys.py.
EXTRAS = (
    ("moe", lambda m: m.moe is not None),
    # Llama 3.1's scaling is torchtitan's Llama 3 "llama" scaling; another type, or any on Qwen3, has none.
    ("rope_scaling", lambda m: m.rope_scaling is not None and (m.rope_scaling.rope_type != "llama3"
                                                               or m.qk_layernorm)),
    ("add_qkv_bias", lambda m: m.add_qkv_bias),
    ("latent_attention", lambda m: m.latent_attention is not None),
    ("sliding_window", lambda m: m.sliding_window is not None or m.layer_types is not None),
    ("softmax_scale", lambda m: m.softmax_scale is not None),
    *((key, lambda m, key=key: getattr(m, key) > 0) for key in ("hidden_dropout", "attention_dropout", "ffn_dropout")),
)
USE_NXDT = "or set training.runtime=nxdt"  # the end of every line that refuses something to torchtitan
# Our optimizers torchtitan has (model.optim.name -> its optimizer_name): what a launch maps and a conversion carries.
OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}


def titan_model(model: ModelConfig, p: str = "training.model.",
                why: Callable[[str], str] = lambda key: "torchtitan's models here have no counterpart") \
        -> tuple[str | None, str]:
    """(torchtitan's model, or None and one line saying why not) for our model: the registry's TORCHTITAN_MODELS at
    our model's shape, without what neither has (EXTRAS; `why(key)` says why, and what to do)."""
    for key, asks in EXTRAS:
        if asks(model):
            value = getattr(model, key)
            shown = value if isinstance(value, (bool, int, float)) else "set (by the YAML or config.json)"
            return None, f"{p}{key}: {shown}; {why(key)}"
    name = torchtitan_model(model)
    if name is None:
        return None, (f"{p}architecture: {model.architecture} has no torchtitan counterpart here; the families both "
                      f"runtimes share are {' and '.join(sorted(TORCHTITAN_MODELS.values()))} (Llama 3 and dense Qwen3 "
                      f"shapes): choose such a recipe (training=llama3/8b, training=qwen3/8b) {USE_NXDT}")
    if not model.qk_layernorm and model.kv_channels not in (None, model.hidden_size // model.num_attention_heads):
        return None, (f"{p}kv_channels: {model.kv_channels} without qk_layernorm: torchtitan's Llama 3 heads are "
                      f"hidden_size / num_attention_heads; unset it {USE_NXDT}")
    return name, ""


def titan_shape(model: ModelConfig, vocab_known: bool = True) -> dict[str, Any]:
    """model_spec's keyword arguments for our model (contract 1's `model`): None where torchtitan's default applies.
    vocab_size is our embedding's rows but those we pad a source model with (torchtitan pads nothing), or None where
    the tokenizer is not here yet (the job reads it then: runtime/titan/model.py vocab_size)."""
    qk_norm = model.qk_layernorm  # Qwen3's: its own head size, q/k norms
    scaling = model.rope_scaling
    return {
        "dim": model.hidden_size, "n_layers": model.num_layers, "n_heads": model.num_attention_heads,
        "n_kv_heads": model.kv_heads, "hidden_dim": model.ffn_hidden_size,
        "vocab_size": (model.padding_from or model.vocab_size) if vocab_known else None,
        "rope_theta": model.rotary_base, "norm_eps": model.layernorm_epsilon,
        "max_seq_len": model.max_position_embeddings,
        "head_dim": model.head_dim if qk_norm else None, "qk_norm": True if qk_norm else None,
        "tie_embeddings": model.share_embeddings_and_output_weights,
        # Llama 3.1's, with Hugging Face's keys (torchtitan's RoPE "llama" scaling takes the same four numbers).
        "rope_scaling": None if scaling is None else {
            "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings},
    }
