# LoRA runs for Hugging Face tools: our adapters (runtime/models/lora.py) under Hugging Face PEFT's names and
# adapter_config.json, and the base weights a LoRA checkpoint lacks. A LoRA run's checkpoints hold only what
# trains (the adapters and their optimizer state); the base comes from the run's model.restore_from_path, or from
# its seed when it started from random init.
#
# Our fused projections carry several PEFT modules each: A and B of target t in `layers.<i>.attn.qkv.lora.A.<t>`
# are PEFT's `base_model.model.model.layers.<i>.self_attn.<t>.lora_A.weight` (rank x in) and `...lora_B.weight`
# (out_t x rank), with the same scale alpha / rank. runtime/convert/hf.py only splits our [q | k | v] rows (no
# per-head permutation: both sides apply RoPE in the rotate-half layout), so B's rows are taken as they are.
# Multi-head latent attention's projections (q_a_proj, ..., kv_b_proj) are one target each, under self_attn too,
# their weights stored as Hugging Face holds them (interleaved RoPE pairs included), so B's rows are theirs as well.
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.convert.pretrained import read_pretrained  # one reader of starting weights, as training uses
from runtime.models import build_model
from runtime.models.lora import adapter_names, is_adapter, projection_inputs, projection_segments
from runtime.schema.families import family_for
from runtime.schema.model import ModelConfig
from runtime.schema.training import saved_lora
from runtime.schema.training_config import LoraConfig

ADAPTER_DIR = "adapter"              # the PEFT adapter's subdirectory of an export
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_of(training: dict, where: str, cfg: ModelConfig | None = None) -> LoraConfig | None:
    """A checkpoint's LoRA settings from its config.yaml (model.peft), or None when it is not a LoRA run's; its
    target names as the model `cfg` (when given) has them (a group on multi-head latent attention)."""
    lora, report = saved_lora(training.get("model") or {}, cfg)
    if report.errors:
        raise ValueError(f"{where} config.yaml: {report.errors[0]}")
    return lora


def load_base(training: dict, cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """The full base weights (our names) of a LoRA run: from its model.restore_from_path (a Hugging Face directory
    or a checkpoint of ours), checked to hold every weight of `cfg` at its shape; without one, the random init of
    the model config's seed, which is exactly the frozen base the run trained its adapters on (init.py makes every
    layout's values from the seed)."""
    path = (training.get("model") or {}).get("restore_from_path")
    if not path:
        return build_model(cfg).state_dict()
    return read_pretrained(str(path), cfg)


def adapters(state: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The adapter tensors of `state`, checked to be exactly A and B of every layer's `lora.target_modules`
    at the shapes `cfg` and the rank make."""
    expected: dict[str, tuple[int, int]] = {}
    for local, segments in projection_segments(cfg).items():
        for target, rows in segments:
            if target not in lora.target_modules:
                continue
            columns = projection_inputs(cfg, local)
            for i in range(cfg.num_layers):
                module = f"layers.{i}.{local}.lora"
                expected[f"{module}.A.{target}"] = (lora.rank, columns)
                expected[f"{module}.B.{target}"] = (rows, lora.rank)
    found = {name: tensor for name, tensor in state.items() if is_adapter(name)}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's adapters do not match model.peft (rank {lora.rank}, target_modules "
                         f"{list(lora.target_modules)}): missing {missing[:3]} ({len(missing)} in all), "
                         f"unexpected {unexpected[:3]} ({len(unexpected)} in all)")
    for name, shape in expected.items():
        if tuple(found[name].shape) != shape:
            raise ValueError(f"the checkpoint's adapter {name} has shape {tuple(found[name].shape)}; model.peft "
                             f"and the model keys make {shape}")
    return found


def check_peft_exportable(cfg: ModelConfig) -> None:
    refusal = getattr(family_for(cfg), "PEFT_REFUSAL", None)
    if refusal:
        raise ValueError(refusal)


def peft_name(name: str) -> str:
    """`layers.3.attn.qkv.lora.B.k_proj` -> `base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight`."""
    parts = adapter_names(name)
    assert parts is not None, name
    module, factor, target = parts
    _, layer, path = module.split(".", 2)  # layers.<i>.attn.qkv
    block = "self_attn" if path.startswith("attn.") else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{factor}.weight"


def to_peft(full_state: dict[str, torch.Tensor], model_cfg: ModelConfig, lora_cfg: LoraConfig, *,
            base_model_name_or_path: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Our full state (adapters, with or without the base weights) -> (PEFT adapter state dict, adapter_config.json
    dict). The same mapping serves the Adam moments (same names, same shapes)."""
    check_peft_exportable(model_cfg)
    found = adapters(full_state, model_cfg, lora_cfg)
    state = {peft_name(name): tensor.detach().contiguous().clone() for name, tensor in sorted(found.items())}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
              "lora_dropout": lora_cfg.dropout, "target_modules": sorted(lora_cfg.target_modules), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path}
    return state, config


def save_adapter(directory: str | os.PathLike, adapter_state: dict[str, torch.Tensor], adapter_config: dict,
                 moments: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (what PeftModel.from_pretrained reads); `moments`
    ({"exp_avg": PEFT-named state, ...}) go to optimizer/<key>.safetensors."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8")
    save_file(adapter_state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    for key, state in (moments or {}).items():
        (out / "optimizer").mkdir(exist_ok=True)
        save_file(state, str(out / "optimizer" / f"{key}.safetensors"), metadata={"format": "pt"})
    return out


__all__ = ["ADAPTER_DIR", "adapters", "check_peft_exportable", "load_base", "lora_of", "peft_name", "save_adapter",
           "to_peft"]
