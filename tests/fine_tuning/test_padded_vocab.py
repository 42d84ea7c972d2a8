"""Fine-tuning a Hugging Face model whose vocab_size (600) is not a multiple of make_vocab_size_divisible_by (128,
which fine_tuning=hf/sft_demo inherits from llama/tiny): the dry run accepts it, the run trains (it stopped after
launch on "(600, 64) but the model config makes (640, 64)"), and the export is a 600-token model that transformers
loads and that computes our logits. Training with the padded rows is exactly training the unpadded model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import read_config, resolve_checkpoint
from runtime.config import parse_model_config
from runtime.finetune import load_pretrained
from runtime.models import build_model
from runtime.schema.training import parse_model
from runtime.sft.synthetic import write_demo
from tests.checkpoint.launch_helpers import stages_here
from tests.launcher.helpers import nxdt

transformers = pytest.importorskip("transformers")
VOCAB = 600
SHORT = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.devices=2",
         "trainer.preflight=false", "model.tensor_model_parallel_size=2", "model.global_batch_size=4",
         "model.micro_batch_size=2", "model.encoder_seq_length=64", "model.optim.sched.warmup_steps=1",
         "exp_manager.create_tensorboard_logger=false", "exp_manager.create_metrics_plot=false"]


def _hf_llama(directory: Path, tokenizer_dir: Path | None = None):
    """A tiny untied Llama with 600 tokens written by transformers (with the chat demo's tokenizer beside it)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ():
        shutil.copyfile(tokenizer_dir / name, directory / name)
    return model


@pytest.mark.long("the launcher's dry run, two forked tp2 ranks fine-tuning 2 steps, then the conversion stage")
def test_fine_tunes_and_exports_a_600_token_model_under_tp2(tmp_path):
    data = tmp_path / "data"
    write_demo(data / "sft_demo", num_train=40, num_valid=8, num_test=8, seed=3, vocab_size=512)
    _hf_llama(tmp_path / "hf", data / "sft_demo")
    overrides = ["cluster_type=local", f"data_dir={data}", f"base_results_dir={tmp_path}/results",
                 "fine_tuning=hf/sft_demo", f"fine_tuning.model.restore_from_path={tmp_path}/hf",
                 *(f"fine_tuning.{o}" for o in SHORT)]
    # The dry run renders the stages; the fine-tuning's two ranks are forked from this process and the conversion's
    # command runs in it (the launch through torchrun is tests/fine_tuning/test_fine_tuning_pipeline.py's).
    run = tmp_path / "results" / "hf_sft_demo"
    assert stages_here(["stages=[fine_tuning,conversion]", *overrides], tmp_path, run, "fine_tuning") == [0, 0]

    exported = run / "conversion" / "hf_model"
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == VOCAB
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # Ours: the fine-tuned checkpoint in the model its saved config rebuilds (640 rows, 600 of them tokens).
    storage, checkpoint = resolve_checkpoint(str(run / "fine_tuning" / "checkpoints"))
    training = read_config(storage, checkpoint)
    cfg = parse_model_config(training["model"], training["model"]["tokenizer"]["model"])
    assert (cfg.vocab_size, cfg.unpadded_vocab_size) == (640, VOCAB)
    ours = build_model(cfg).eval()
    load_pretrained(ours, str(run / "fine_tuning" / "checkpoints"))
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected = ours(ids), theirs.eval()(ids).logits
    assert bool(torch.isneginf(logits[..., VOCAB:]).all())
    diff = (logits[..., :VOCAB] - expected).abs().max().item()
    assert diff <= 2e-4, diff
    assert not torch.equal(ours.output.weight[:VOCAB], _hf_llama(tmp_path / "base").lm_head.weight), "it trained"


def test_training_the_padded_model_is_training_the_unpadded_one(tmp_path):
    """The same Hugging Face weights loaded unpadded (600 rows) and padded to 640: the same per-token losses and the
    same gradients, and none at all for the padded rows (so they stay zero under any optimizer)."""
    from tests.recipe_data import write_tokenizer

    _hf_llama(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf" / "tokenizer.json", VOCAB)
    models = []
    for divisor in (None, 128):
        section = {"restore_from_path": str(tmp_path / "hf"), **({"make_vocab_size_divisible_by": divisor}
                                                                  if divisor else {})}
        cfg, report = parse_model(section)
        report.raise_if_any()
        model = build_model(cfg)
        load_pretrained(model, str(tmp_path / "hf"))
        models.append(model)
    assert [m.cfg.vocab_size for m in models] == [VOCAB, 640]
    ids = torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in models:
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.mean().backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    unpadded, padded = (dict(m.named_parameters()) for m in models)
    for name, value in unpadded.items():
        torch.testing.assert_close(padded[name].grad[:value.shape[0]], value.grad, rtol=1e-5, atol=1e-7, msg=name)
    for name in ("embed.word.weight", "output.weight"):
        assert torch.equal(padded[name].grad[VOCAB:], torch.zeros(640 - VOCAB, 64)), name
