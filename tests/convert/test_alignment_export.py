# A LoRA alignment run (DPO or ORPO with model.peft) is exported like a peft run's: the conversion stage reads the
# checkpoint's config.yaml, whose model.peft and model.restore_from_path rebuild base + adapters, whatever stage
# wrote it. Its alignment keys (strategy, model_alignment_strategy) are the trainer's, not the export's.
from __future__ import annotations

import pytest

from runtime.checkpoint import write_full_checkpoint
from tests.convert.test_peft_export import PEFT_SECTION, TOLERANCE, _convert, _diff, _hf, _peft, run

__all__ = ["run"]  # a fixture, used by name


@pytest.mark.parametrize("strategy", ["dpo", "orpo"])
def test_a_lora_alignment_checkpoint_exports_merged_and_as_an_adapter(tmp_path, run, capsys, strategy):
    cfg, model = run["cfg"], run["model"]
    section = {"dpo": {"kl_beta": 0.1, "precompute_ref_log_probs": False}, "orpo": {"beta": 0.1}}[strategy]
    config = {"strategy": strategy, "model_alignment_strategy": {strategy: section},
              "model": {**run["keys"], "tokenizer": {"library": "huggingface", "model": run["tokenizer"]},
                        "peft": PEFT_SECTION, "restore_from_path": str(tmp_path / "base_hf"),
                        "data": {"train_ds": {"file_names": ["/data/preference/train.jsonl"]}}}}
    checkpoint = str(tmp_path / "aligned")
    write_full_checkpoint(checkpoint, 20, run["trained"], config=config)  # the adapters only, as LoRA saves
    out = tmp_path / "out"
    code, said = _convert(tmp_path, capsys, checkpoint_dir=checkpoint, output_dir=str(out), lora="both")
    assert code == 0, said
    assert _diff(model, _hf(out), cfg.vocab_size) <= TOLERANCE
    assert _diff(model, _peft(out / "base", out / "adapter"), cfg.vocab_size) <= TOLERANCE
