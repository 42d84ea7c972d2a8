# Reading a model's starting weights (model.restore_from_path): a Hugging Face directory, imported on the fly, or a
# checkpoint of ours, weights only; under our parameter names, checked against the config's shapes. Conversion owns
# it because both sources are formats it converts; fine-tuning (runtime/finetune.py) and the LoRA export (peft.py)
# read starting weights through it, so the two cannot disagree about them.
#
# read_selected is what a training rank uses: each of its parameters' selection of the full tensor (its TP rows,
# its experts), read one tensor at a time. From safetensors only those rows or columns are read (hf.SlicedReader),
# from a checkpoint of ours only their byte ranges (ranged_full_tensors, as resume reads); the other HF forms (.bin,
# legacy names) are read whole, as before.
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from runtime.checkpoint import full_tensors, ranged_full_tensors, read_rank_files, resolve_checkpoint
from runtime.checkpoint.reshard import Target
from runtime.convert.hf import (VOCAB_ROWS, SlicedReader, check_weight, load_hf_directory, pad_vocab, padded_rows,
                               state_shapes)
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
        for name, tensor in state.items():  # a Hugging Face directory's tensors were checked as they were read
            _checked(name, tensor, where, key)
    _check_names(expected, set(state), cfg, where, key, any(".lora." in n for n in state))
    state = pad_vocab(state, cfg)  # the source's vocab_size rows, then cfg's padding
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{key}: {where} holds {name} with shape {tuple(state[name].shape)} but the model "
                             f"config makes {tuple(shape)}; {_SHAPE_HINT}")
    if cfg.share_embeddings_and_output_weights and "output.weight" not in state:
        state["output.weight"] = state["embed.word.weight"]
    return state


def _checked(name: str, tensor: torch.Tensor, where: str, key: str) -> torch.Tensor:
    """A weight from a checkpoint of ours passes the same check as one from a Hugging Face file (hf.check_weight)."""
    try:
        check_weight(name, tensor, where)
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None
    return tensor


_SHAPE_HINT = ("set the model keys from its config (model.model_config=<dir>/config.json for a Hugging Face model) "
               "or choose weights of this model")


def _check_names(expected: dict, present: set, cfg: ModelConfig, where: str, key: str, adapters: bool) -> None:
    tied = cfg.share_embeddings_and_output_weights
    missing = [n for n in expected if n not in present and not (tied and n == "output.weight")]
    if missing:
        hint = " (a LoRA run saves its adapters only: export it merged, or restore from its own base)" \
            if adapters or not present else ""
        raise ValueError(f"{key}: {where} has no {missing[0]} ({len(missing)} weights missing): it is not a "
                         f"{cfg.architecture} model of this shape{hint}")


Selected = dict[str, tuple[str, dict]]  # a local name -> (our full name, its selection: dim -> full indices)


def read_selected(path: str, cfg: ModelConfig, targets: Selected, key: str = KEY
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, the starting weight at its selection) for each of `targets`, one at a time: a rank never
    holds another rank's part, nor (from safetensors) reads it."""
    if is_hf_directory(path):
        try:
            reader = SlicedReader(path, cfg)
        except ValueError as error:
            raise ValueError(f"{key}: {path}: {error}") from None
        if reader.available:
            try:
                reader.check()
            except ValueError as error:
                raise ValueError(f"{key}: the Hugging Face model in {path} {error}; {_SHAPE_HINT}") from None
            for local, (full, select) in targets.items():
                try:
                    part = reader.read(full, select)
                except ValueError as error:  # a tensor's values (hf.check_weight): the message names its file
                    raise ValueError(f"{key}: {error}") from None
                yield local, part
            return
        state = read_pretrained(path, cfg, key)
        for local, (full, select) in targets.items():
            yield local, Target((), select).take(state[full])
        return
    yield from _from_checkpoint(path, cfg, targets, key)


def _from_checkpoint(path: str, cfg: ModelConfig, targets: Selected, key: str
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint of ours: each target's selection read by byte ranges (ranged_full_tensors), so a rank reads
    its own rows and never assembles a full tensor."""
    try:
        storage, checkpoint = resolve_checkpoint(path)
    except ValueError as error:
        raise ValueError(f"{key}: {error}; point it at a Hugging Face model directory or a checkpoint") from None
    where = f"checkpoint {storage.root}/{checkpoint.name}"
    expected = state_shapes(cfg)
    with ranged_full_tensors(storage, checkpoint) as full:
        _check_names(expected, {n for n in expected if full.has(n, "value")}, cfg, where, key,
                     any(".lora." in n for n in full.names()))
        for local, (name, select) in targets.items():
            shape = tuple(full.full_shape(name, "value"))
            if name in VOCAB_ROWS and cfg.padding_from is not None and shape == (cfg.padding_from,
                                                                                 *expected[name][1:]):
                # Its source's rows (a Hugging Face import's, say): cfg pads them
                part = padded_rows(lambda rows: full.read(name, "value", {0: rows}), select, cfg, name)
                yield local, _checked(name, part, where, key)
                continue
            if shape != tuple(expected[name]):
                raise ValueError(f"{key}: {where} holds {name} with shape {shape} but the model config makes "
                                 f"{tuple(expected[name])}; {_SHAPE_HINT}")
            yield local, _checked(name, full.read(name, "value", select), where, key)
