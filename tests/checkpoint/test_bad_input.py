# User mistakes in the checkpoint, conversion and evaluation configs: one `error:` line naming the key, exit 2,
# no traceback, nothing written.
import pytest
import yaml

from runtime.config import parse_training_config
from runtime.convert.__main__ import main as convert
from runtime.evaluate.__main__ import main as evaluate
from tests.runtime_train.helpers import build_tokenizer, reference_training_config, write_mmidx


def _run(program, tmp_path, capsys, cfg: dict) -> str:
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert program(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("cfg, expected", [
    ({"mode": "sideways", "checkpoint_dir": "x"}, "conversion.mode: 'sideways' is not one of export, import"),
    ({"mode": "export", "checkpoint_dir": "EMPTY", "output_dir": "out"}, "holds no complete checkpoint"),
    ({"mode": "export", "checkpoint_dir": "EMPTY", "checkpoint_name": "step_00000005.abcd", "output_dir": "out"},
     "is incomplete (no COMMIT marker)"),
    ({"mode": "import", "checkpoint_dir": "EMPTY"}, "conversion.hf_checkpoint_dir: missing"),
])
def test_conversion_mistakes_are_one_line(tmp_path, capsys, cfg, expected):
    (tmp_path / "empty").mkdir()
    cfg = {k: str(tmp_path / "empty") if v == "EMPTY" else v for k, v in cfg.items()}
    assert expected in _run(convert, tmp_path, capsys, cfg)
    assert not (tmp_path / "out").exists()


def test_evaluation_of_a_directory_without_checkpoints_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cfg = {"run": {"results_dir": str(tmp_path / "eval")}, "checkpoint_dir": str(tmp_path / "empty"),
           "tasks": ["validation_loss"]}
    assert "holds no complete checkpoint" in _run(evaluate, tmp_path, capsys, cfg)
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("top_k", [0, -2])
def test_save_top_k_zero_or_below_minus_one_names_the_key(tmp_path, top_k):
    build_tokenizer(tmp_path / "tokenizer.json", ["a", "b"])
    write_mmidx(tmp_path / "x", [[1, 2, 1, 2]])
    raw = reference_training_config("gpt", results_dir=tmp_path / "r", data_prefix=[1, str(tmp_path / "x")],
                                    tokenizer=tmp_path / "tokenizer.json")
    raw["exp_manager"]["checkpoint_callback_params"]["save_top_k"] = top_k
    with pytest.raises(ValueError, match=r"exp_manager.checkpoint_callback_params.save_top_k: .* -1 to keep all"):
        parse_training_config(raw)
