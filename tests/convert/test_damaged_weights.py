# Damaged Hugging Face weights (issue 39): a truncated download, a zeroed header, a shard the index names but the
# directory lacks. Each is one line naming the file, from the header-only checker (runtime/schema/safetensors_file.py)
# at launch, and from the converter on the node, never safetensors' traceback. Also checkpoint_name values that
# would leave checkpoint_dir. Every file here is real: written by safetensors or save_hf_directory, then damaged.
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.convert.hf import load_hf_directory, save_hf_directory
from runtime.convert.pretrained import read_pretrained, read_selected
from runtime.models import ModelConfig, build_model
from runtime.schema.conversion import parse_conversion
from runtime.schema.evaluation import parse_evaluation
from runtime.schema.safetensors_file import hf_weights_problems, safetensors_problem
from tests.launcher.helpers import nxdt, refused
from tests.launcher.test_fine_tuning_stages import _sft_demo_files

# llama/tiny's shape (the fine_tuning recipe's), so that a launch's config.json check agrees with the recipe.
TINY = ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, num_layers=4, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=352, max_position_embeddings=128)


def _tensors(path: Path) -> bytes:
    save_file({"a": torch.ones(4, 8), "b": torch.arange(3)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _header_length(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


# What each damage leaves of a file, and what the checker says of it. "b" is I64 (3,) = 24 bytes, first (safetensors
# orders by alignment), then "a", F32 (4, 8) = 128: 152 bytes of data.
DAMAGES = {
    "truncated": (lambda d: d[:-10], "truncated: its tensors need 152 bytes of data but it holds 142"),
    "header zeroed": (lambda d: bytes(8) + d[8:], "not a safetensors file: header length 0"),
    "header cut": (lambda d: d[:8 + _header_length(d) // 2], "truncated: its header needs"),
    "shorter than 8 bytes": (lambda d: d[:5], "it holds 5 bytes, fewer than the 8 of its header length"),
    "header length absurd": (lambda d: (2**40).to_bytes(8, "little") + d[8:], "over safetensors' limit"),
    "JSON corrupt": (lambda d: d[:8] + b"[" + d[9:], "its header is not valid JSON"),
    "unknown dtype": (lambda d: d.replace(b'"F32"', b'"F33"'), "tensor 'a': dtype 'F33' is not a safetensors dtype"),
    "shape against offsets": (lambda d: d.replace(b"[4,8]", b"[4,9]"),
                              "tensor 'a': data_offsets [24, 152] span 128 bytes but shape [4, 9] of F32 needs 144"),
    "bytes after the data": (lambda d: d + bytes(8), "8 bytes after its last tensor's data"),
}


def test_a_whole_file_passes(tmp_path):
    path = tmp_path / "whole.safetensors"
    _tensors(path)
    assert safetensors_problem(path) is None


@pytest.mark.parametrize("damage", DAMAGES)
def test_each_damage_is_one_line_naming_the_file(damage, tmp_path):
    change, expected = DAMAGES[damage]
    path = tmp_path / "model.safetensors"
    path.write_bytes(change(_tensors(path)))
    with pytest.raises(SafetensorError):  # safetensors itself refuses every one of them, as a traceback
        load_file(str(path))
    problem = safetensors_problem(path)
    assert problem is not None and problem.startswith(f"{path}: ") and "\n" not in problem
    assert expected in problem, problem


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, Path]:
    """llama/tiny's weights as Hugging Face directories: one file, and sharded with an index."""
    root = tmp_path_factory.mktemp("hf")
    state = build_model(TINY).state_dict()
    return {"single": save_hf_directory(root / "single", state, TINY, None),
            "sharded": save_hf_directory(root / "sharded", state, TINY, None, max_shard_bytes=400_000)}


def _damaged(whole: dict[str, Path], tmp_path: Path, case: str) -> tuple[Path, str]:
    """A copy of a whole directory with `case` done to it, and what the checker says of it."""
    kind = "single" if case in ("truncated", "header zeroed", "no weights") else "sharded"
    folder = tmp_path / f"hf_{case.replace(' ', '_')}"
    folder.mkdir()
    for file in whole[kind].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    shards = sorted(folder.glob("model-*.safetensors"))
    if case == "truncated":
        file = folder / "model.safetensors"
        file.write_bytes(file.read_bytes()[:-1000])
        return folder, f"{file}: truncated: its tensors need"
    if case == "header zeroed":
        file = folder / "model.safetensors"
        file.write_bytes(bytes(8) + file.read_bytes()[8:])
        return folder, f"{file}: not a safetensors file: header length 0"
    if case == "missing shard":
        shards[-1].unlink()
        return folder, f"{folder / 'model.safetensors.index.json'} names {shards[-1].name}, which is not in {folder}"
    if case == "damaged shard":
        shards[0].write_bytes(shards[0].read_bytes()[:-4])
        return folder, f"{shards[0]}: truncated: its tensors need"
    if case == "no weights":  # issue 58: config.json and the tokenizer, the weights never downloaded
        (folder / "model.safetensors").unlink()
        return folder, f"{folder} has no weights: expected model.safetensors, model.safetensors.index.json, "
    assert case == "index not JSON"
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    return folder, f"{folder / 'model.safetensors.index.json'}: not a safetensors index"


CASES = ["truncated", "header zeroed", "missing shard", "damaged shard", "index not JSON", "no weights"]


def test_whole_directories_pass(whole):
    assert len(list(whole["sharded"].glob("model-*.safetensors"))) > 2
    assert hf_weights_problems(whole["single"]) == [] and hf_weights_problems(whole["sharded"]) == []
    for folder in whole.values():  # and an import of them passes the launch's parse
        assert parse_conversion({"mode": "import", "checkpoint_dir": "/ckpt", "hf_checkpoint_dir": str(folder)})[0]


@pytest.mark.parametrize("case", CASES)
def test_the_node_refuses_a_damaged_directory_with_one_line(case, whole, tmp_path):
    """What a fine-tuning worker (read_pretrained) and the conversion import (load_hf_directory) read: a ValueError
    naming the file, which their entry points print as one `error:` line; never a SafetensorError."""
    folder, expected = _damaged(whole, tmp_path, case)
    assert any(expected in line for line in hf_weights_problems(folder)), hf_weights_problems(folder)
    with pytest.raises(ValueError) as caught:
        load_hf_directory(folder)
    assert expected in str(caught.value)
    with pytest.raises(ValueError, match="model.restore_from_path: ") as caught:
        read_pretrained(str(folder), TINY)
    assert expected in str(caught.value)
    # What a training rank reads: its own slices (hf.SlicedReader), refused the same way before any slice is read.
    with pytest.raises(ValueError, match="model.restore_from_path: ") as caught:
        next(read_selected(str(folder), TINY, {"embed.word.weight": ("embed.word.weight", {})}))
    assert expected in str(caught.value)


def _refused(result, expected: str, results: Path) -> None:
    refused(result, expected)
    assert not results.exists(), "a refused launch wrote files"


@pytest.mark.parametrize("case", ["truncated", "missing shard", "no weights"])
def test_a_fine_tuning_launch_refuses_damaged_starting_weights(case, whole, tmp_path):
    folder, expected = _damaged(whole, tmp_path, case)
    _sft_demo_files(tmp_path / "data")
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
                  "stages=[fine_tuning]", f"fine_tuning.model.restore_from_path={folder}", cwd=tmp_path)
    _refused(result, f"fine_tuning.model.restore_from_path: {expected}", tmp_path / "results")
    assert "re-download it, or point fine_tuning.model.restore_from_path at a complete copy" in result.stderr


def test_a_conversion_import_refuses_damaged_weights(whole, tmp_path):
    folder, expected = _damaged(whole, tmp_path, "header zeroed")
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
                  "stages=[conversion]", "conversion.mode=import", f"conversion.hf_checkpoint_dir={folder}",
                  f"conversion.checkpoint_dir={tmp_path}/imported", "--dry-run", cwd=tmp_path)
    _refused(result, f"conversion.hf_checkpoint_dir: {expected}", tmp_path / "results")
    assert not (tmp_path / "imported").exists()


def test_the_conversion_stage_on_the_node_refuses_damaged_weights(whole, tmp_path, capsys):
    from runtime.convert.__main__ import main

    folder, expected = _damaged(whole, tmp_path, "damaged shard")
    config = tmp_path / "conversion_config.yaml"
    config.write_text(json.dumps({"mode": "import", "checkpoint_dir": str(tmp_path / "imported"),
                                  "hf_checkpoint_dir": str(folder)}))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: conversion.hf_checkpoint_dir: {expected}") and "\n" not in err, err
    assert not (tmp_path / "imported").exists()


LEAVING = [("../../etc", "leaves"), ("/etc", "leaves"), ("step_00000040.3f9c2a1b/../..", "leaves"),
           ("runs/step_00000040.3f9c2a1b", "is not one directory name in")]


@pytest.mark.parametrize("name,says", LEAVING)
def test_checkpoint_name_stays_inside_checkpoint_dir(name, says):
    for parse, stage, extra in ((parse_conversion, "conversion", {"output_dir": "/out"}),
                                (parse_evaluation, "evaluation", {"run": {"results_dir": "/r"},
                                                                  "tasks": ["validation_loss"]})):
        cfg, report = parse({"checkpoint_dir": "/ckpt", "checkpoint_name": name, **extra}, f"{stage}.")
        assert cfg is None and report.errors == [
            f"{stage}.checkpoint_name: {name!r} {says} {stage}.checkpoint_dir; give one checkpoint's directory name "
            f"in it (e.g. step_00000040.3f9c2a1b) or latest"]
    for fine in ("latest", "step_00000040.3f9c2a1b"):
        assert parse_conversion({"checkpoint_dir": "/ckpt", "checkpoint_name": fine, "output_dir": "/o"})[0]


@pytest.mark.parametrize("stage", ["conversion", "evaluation"])
def test_a_launch_refuses_a_checkpoint_name_that_leaves_checkpoint_dir(stage, tmp_path):
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
                  f"stages=[{stage}]", f"{stage}.checkpoint_name=../../etc", "--dry-run", cwd=tmp_path)
    _refused(result, f"{stage}.checkpoint_name: '../../etc' leaves {stage}.checkpoint_dir; give one checkpoint's "
                     f"directory name in it (e.g. step_00000040.3f9c2a1b) or latest", tmp_path / "results")


def test_an_index_that_misplaces_a_tensor_is_one_line_on_the_sliced_read(whole, tmp_path):
    """Every file whole, but the index sends a tensor to a file that does not hold it (an index from another
    download): the rank's sliced read names the file and the tensor instead of safetensors' traceback."""
    folder = tmp_path / "hf_misplaced"
    folder.mkdir()
    for file in whole["sharded"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    wrong = files[0] if index["weight_map"]["model.norm.weight"] != files[0] else files[-1]
    index["weight_map"]["model.norm.weight"] = wrong
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as caught:
        list(read_selected(str(folder), TINY, {"final_norm.weight": ("final_norm.weight", {})}))
    line = str(caught.value)
    assert f"{folder / wrong}: has no tensor model.norm.weight" in line and "\n" not in line, line
