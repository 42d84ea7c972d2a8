# Reading a model's starting weights (model.restore_from_path): a Hugging Face directory, imported on the fly, or a
# checkpoint of ours, weights only; the whole tensors under our parameter names, checked against the config's
# shapes. Conversion owns it because both sources are formats it converts; fine-tuning (runtime/finetune.py) and
# the LoRA export (peft.py) read starting weights through it, so the two cannot disagree about them.
from __future__ import annotations

from pathlib import Path

import torch

from runtime.checkpoint import full_tensors, read_rank_files, resolve_checkpoint
from runtime.convert.hf import load_hf_directory, state_shapes
from runtime.schema.model import ModelConfig

KEY = "model.restore_from_path"


def is_hf_directory(path: str) -> bool:
    return not str(path).startswith("s3://") and (Path(path) / "config.json").is_file()


def read_pretrained(path: str, cfg: ModelConfig, key: str = KEY) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights at `path`, under our parameter names, checked against `cfg`'s shapes."""
    expected = state_shapes(cfg)
    if is_hf_directory(path):
        try:
            state, _, _ = load_hf_directory(path)
        except ValueError as error:
            raise ValueError(f"{key}: {path}: {error}") from None
        where = f"the Hugging Face model in {path}"
    else:
        try:
            storage, checkpoint = resolve_checkpoint(path)
        except ValueError as error:
            raise ValueError(f"{key}: {error}; point it at a Hugging Face model directory or a checkpoint") \
                from None
        full = full_tensors(read_rank_files(storage, checkpoint))
        state = {name: full.get(name, "value") for name in expected if full.has(name, "value")}
        where = f"checkpoint {storage.root}/{checkpoint.name}"
    tied = cfg.share_embeddings_and_output_weights
    missing = [n for n in expected if n not in state and not (tied and n == "output.weight")]
    if missing:
        hint = " (a LoRA run saves its adapters only: export it merged, or restore from its own base)" \
            if any(".lora." in n for n in state) or not state else ""
        raise ValueError(f"{key}: {where} has no {missing[0]} ({len(missing)} weights missing): it is not a "
                         f"{cfg.architecture} model of this shape{hint}")
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{key}: {where} holds {name} with shape {tuple(state[name].shape)} but the model "
                             f"config makes {tuple(shape)}; set the model keys from its config (model.model_config"
                             f"=<dir>/config.json for a Hugging Face model) or choose weights of this model")
    return state
