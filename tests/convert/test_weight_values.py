# Starting weights whose files are whole but whose tensors are not a model's (issue 57): an integer tensor, NaN or
# inf values, a tensor the config has no place for, a pytorch_model.bin pickling other objects. The conversion import
# (load_hf_directory) and a fine-tuning rank (read_pretrained, read_selected: its own slices) refuse each the same
# way, in one line naming the tensor and its file, where they used to import them (exit 0) or cast them silently.
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.convert.hf import load_hf_directory, save_hf_directory
from runtime.convert.pretrained import read_pretrained, read_selected
from runtime.models import ModelConfig, build_model

SMALL = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=2,
                    num_query_groups=1, ffn_hidden_size=64, max_position_embeddings=32)
NORM = "model.norm.weight"  # our final_norm.weight


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    return save_hf_directory(tmp_path_factory.mktemp("hf") / "whole", build_model(SMALL).state_dict(), SMALL, None)


def _changed(whole: Path, folder: Path, change) -> Path:
    """A copy of the whole directory whose model.safetensors has `change` done to its tensors."""
    folder.mkdir()
    for file in whole.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


CHANGES = {
    "int64": (lambda t: t.update({NORM: torch.ones_like(t[NORM], dtype=torch.int64)}),
              f"tensor {NORM} is int64, not floating point"),
    "all NaN": (lambda t: t.update({NORM: torch.full_like(t[NORM], float("nan"))}),
                f"tensor {NORM} holds NaN or inf values"),
    "+inf": (lambda t: t[NORM].__setitem__(3, float("inf")), f"tensor {NORM} holds NaN or inf values"),
}


def test_whole_weights_read(whole):
    load_hf_directory(whole)
    assert read_pretrained(str(whole), SMALL)["final_norm.weight"].dtype == torch.float32
    assert list(read_selected(str(whole), SMALL, {"n": ("final_norm.weight", {})}))[0][1].shape == (32,)


def _refused_everywhere(folder: Path, says: str) -> None:
    with pytest.raises(ValueError) as caught:  # the conversion import
        load_hf_directory(folder)
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value
    with pytest.raises(ValueError, match="^model.restore_from_path: ") as caught:  # fine-tuning, the whole read
        read_pretrained(str(folder), SMALL)
    assert says in str(caught.value)
    with pytest.raises(ValueError, match="^model.restore_from_path: ") as caught:  # a rank's sliced read
        list(read_selected(str(folder), SMALL, {"n": ("final_norm.weight", {0: torch.arange(16)}),
                                                "e": ("embed.word.weight", {})}))
    assert says in str(caught.value)


@pytest.mark.parametrize("case", CHANGES)
def test_values_that_are_not_weights_are_refused_naming_tensor_and_file(case, whole, tmp_path):
    change, says = CHANGES[case]
    folder = _changed(whole, tmp_path / "hf", change)
    _refused_everywhere(folder, f"{folder / 'model.safetensors'}: {says}")


def test_an_unexpected_tensor_is_refused_by_fine_tuning_as_by_import(whole, tmp_path):
    folder = _changed(whole, tmp_path / "hf", lambda t: t.update({"model.extra.weight": torch.zeros(4)}))
    _refused_everywhere(folder, "does not match the model config: missing [] (0 in all), unexpected "
                                "['model.extra.weight'] (1 in all)")


def test_a_pytorch_bin_pickling_other_objects_is_one_line(whole, tmp_path):
    folder = tmp_path / "hf_bin"
    folder.mkdir()
    (folder / "config.json").write_text((whole / "config.json").read_text())
    torch.save({"weights": argparse.Namespace(lr=1)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as caught:
        load_hf_directory(folder)
    line = str(caught.value)
    assert line.startswith(f"{folder / 'pytorch_model.bin'}: holds Python objects other than tensors") and \
        "convert it to safetensors" in line and "\n" not in line, line
    with pytest.raises(ValueError, match="^model.restore_from_path: .*holds Python objects other than tensors"):
        read_pretrained(str(folder), SMALL)


def test_the_conversion_stage_on_the_node_refuses_nan_weights(whole, tmp_path, capsys):
    from runtime.convert.__main__ import main

    folder = _changed(whole, tmp_path / "hf", CHANGES["all NaN"][0])
    config = tmp_path / "conversion_config.yaml"
    config.write_text(json.dumps({"mode": "import", "checkpoint_dir": str(tmp_path / "imported"),
                                  "hf_checkpoint_dir": str(folder)}))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: conversion.hf_checkpoint_dir: {folder / 'model.safetensors'}: {CHANGES['all NaN'][1]} " \
                  f"(32 of the 32 read, first: nan); these weights are damaged or diverged: use another copy", err
    assert not (tmp_path / "imported").exists()
