# Running the conversion stage again: its own export of the same checkpoint is left alone, its export of another
# checkpoint is replaced, and a directory someone else filled is kept unless conversion.overwrite=true.
from __future__ import annotations

import dataclasses

import pytest
import yaml

from runtime.convert import save_hf_directory
from runtime.convert.__main__ import PROVENANCE, export, import_hf, main
from runtime.models import ModelConfig, build_model
from runtime.schema.conversion import ConversionConfig
from tests.convert.test_hf import SMALL, _tokenizer

BASE = ConversionConfig(mode="export", checkpoint_dir="", checkpoint_name="latest", output_dir=None,
                        tokenizer_model=None, include_optimizer=False, overwrite=False, hf_checkpoint_dir=None)


@pytest.fixture
def checkpoints(tmp_path):
    """Two runtime checkpoints of a tiny GPT (imported from a Hugging Face directory, as a user would)."""
    _tokenizer(tmp_path / "tokenizer.json", ("<|endoftext|>",))
    cfg = ModelConfig(vocab_size=320, architecture="gpt", **SMALL)
    save_hf_directory(tmp_path / "hf", build_model(cfg).state_dict(), cfg, str(tmp_path / "tokenizer.json"))
    made = []
    for name in ("first", "second"):
        import_hf(dataclasses.replace(BASE, mode="import", checkpoint_dir=str(tmp_path / name),
                                      hf_checkpoint_dir=str(tmp_path / "hf")))
        made.append(str(tmp_path / name))
    return made


def test_a_second_run_keeps_or_replaces_its_own_export(tmp_path, checkpoints, capsys):
    out = tmp_path / "hf_model"
    first = dataclasses.replace(BASE, checkpoint_dir=checkpoints[0], output_dir=str(out))
    export(first)
    weights = (out / "model.safetensors").stat()
    assert (out / PROVENANCE).exists()
    capsys.readouterr()

    export(first)  # the same checkpoint, the same settings: nothing to redo
    assert "nothing to do" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns

    export(dataclasses.replace(first, checkpoint_dir=checkpoints[1]))  # a newer checkpoint: this stage's output
    said = capsys.readouterr().out
    assert "replacing the export of" in said and checkpoints[0] in said
    assert checkpoints[1] in (out / PROVENANCE).read_text()


def test_a_directory_filled_by_someone_else_is_kept_unless_overwrite(tmp_path, checkpoints, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    raw = {"mode": "export", "checkpoint_dir": checkpoints[0], "output_dir": str(out)}
    config = tmp_path / "conversion_config.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "conversion.overwrite=true" in err[0] and str(out) in err[0], err
    assert (out / "notes.txt").read_text() == "mine"

    config.write_text(yaml.safe_dump({**raw, "overwrite": True}))
    assert main(["--config", str(config)]) == 0
    assert (out / "model.safetensors").exists() and not (out / "notes.txt").exists()
