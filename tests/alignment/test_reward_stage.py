"""The rlhf_rm stage (a reward model, runtime/alignment/reward.py) as the launcher composes it: rlhf_rm=llama/tiny on
the preference demo, rendered by the launcher with the conversion stage (--dry-run), its two ranks forked from this
process and the conversion run here (tests/checkpoint/launch_helpers.stages_here); then

- held-out pairwise accuracy: the validation reward_accuracy in metrics.jsonl (valid.jsonl) and the exported
  model's on test.jsonl, far above chance;
- the export: transformers' AutoModelForSequenceClassification loads the directory, and its scores of test pairs
  equal the checkpoint's as our model computes them.

The whole demo through the real CLI (data preparation, 100 steps, conversion) is docs/alignment.md's command; it is
measured at 82 s on 2 CPU cores (held-out accuracy 0.96 at step 25, 1.00 at 100), too long for every run."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from runtime.alignment.data import build_preference_dataset
from runtime.alignment.reward import build_reward_model, scored_positions
from runtime.checkpoint import committed_checkpoints, full_tensors, open_storage, read_rank_files
from runtime.config import parse_model_config
from tests.alignment.test_alignment_e2e import preference_data  # noqa: F401  (the shared demo data fixture)
from tests.checkpoint.launch_helpers import stages_here

STEPS, EVERY, VALID_BATCHES = 30, 15, 2  # 30 steps of 16 pairs; validation on 2 batches: 32 held-out pairs
SEQ, PROMPT = 64, 32  # rows of 64 tokens cut no demo pair (tests/alignment/test_alignment_e2e.py)
TEST_PAIRS = 64       # the fixture's test.jsonl
COMPARED = 8          # test pairs whose scores are compared with transformers'


def _stage(*overrides: str) -> list[str]:
    return [f"rlhf_rm.{o}" for o in ("trainer.log_every_n_steps=1", "trainer.preflight=false",
                                     "exp_manager.create_tensorboard_logger=false",
                                     "exp_manager.create_metrics_plot=false", f"model.encoder_seq_length={SEQ}",
                                     f"reward_model.max_prompt_length={PROMPT}", *overrides)]


@pytest.fixture(scope="module")
def trained(preference_data, tmp_path_factory):  # noqa: F811
    """The stage trained and exported once: (run directory, data directory)."""
    work = tmp_path_factory.mktemp("rm")
    overrides = ["cluster_type=local", "stages=[rlhf_rm,conversion]", "rlhf_rm=llama/tiny",
                 f"data_dir={preference_data}", f"base_results_dir={work}/results",
                 *_stage(f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={EVERY}",
                         f"trainer.limit_val_batches={VALID_BATCHES}", "model.optim.sched.warmup_steps=4")]
    run_dir = work / "results" / "llama_tiny_rm"
    stages_here(overrides, work, run_dir, "rlhf_rm")
    return run_dir, preference_data


def test_held_out_pairs_are_ranked_far_above_chance(trained):
    run_dir, _ = trained
    rows = [json.loads(line) for line in (run_dir / "rlhf_rm" / "metrics.jsonl").read_text().splitlines() if line]
    train = [row for row in rows if "loss" in row]
    valid = [row for row in rows if "val_loss" in row]
    assert [row["step"] for row in train] == list(range(1, STEPS + 1))
    assert [row["step"] for row in valid] == [EVERY, STEPS], valid
    # Random init: the first step's loss is log 2 give or take the seeded head's small scores.
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=0.05), train[0]
    assert {"reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"} <= set(train[0])
    # Measured (seed 1234): val_reward_accuracy 0.97 at step 30 (32 pairs; chance is 0.5 +- 0.09), val_loss 0.18.
    assert valid[-1]["val_reward_accuracy"] >= 0.85, valid
    assert valid[-1]["val_loss"] < valid[0]["val_loss"] < math.log(2), valid
    assert valid[-1]["val_reward_margin"] > 0, valid


def _our_model(run_dir: Path, tokenizer: str):
    """The newest checkpoint's reward model, as our runtime builds it."""
    storage = open_storage(run_dir / "rlhf_rm" / "checkpoints")
    newest = committed_checkpoints(storage)[-1]
    assert newest.step == STEPS
    training = yaml.safe_load((run_dir / "rlhf_rm" / "rlhf_rm_config.yaml").read_text())
    model = build_reward_model(parse_model_config(training["model"], tokenizer)).eval()
    full = full_tensors(read_rank_files(storage, newest.name))
    model.load_state_dict({name: full.get(name, "value") for name in full.names() if full.has(name, "value")})
    return model


def test_export_loads_in_transformers_and_scores_as_ours(trained):
    transformers = pytest.importorskip("transformers")
    run_dir, data = trained
    tokenizer = str(data / "preference_demo" / "tokenizer.json")
    exported = run_dir / "conversion" / "hf_model"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32).eval()
    pairs = build_preference_dataset([data / "preference_demo" / "test.jsonl"], tokenizer, SEQ,
                                     max_prompt_length=PROMPT, cache_dir=run_dir / "test_cache")
    assert len(pairs) == TEST_PAIRS
    samples = torch.from_numpy(np.stack([pairs[i] for i in range(len(pairs))]))  # (N, 2, 4, SEQ)
    rows = samples.reshape(-1, 4, SEQ)  # chosen, rejected, chosen, ...
    ids, labels, mask = rows[:, 0], rows[:, 1], rows[:, 2]
    tokens = torch.cat([ids[:, :1], labels[:, :-1]], dim=1)  # each row's whole sequence (reward.py)
    at = scored_positions(mask.float())
    pad = config["pad_token_id"]
    padded = torch.full_like(tokens, pad)
    for row, end in enumerate(at.tolist()):  # transformers scores the last token that is not padding
        padded[row, :end + 1] = tokens[row, :end + 1]
    assert not (tokens[torch.arange(len(tokens)), at] == pad).any()
    with torch.no_grad():
        theirs = hf(input_ids=padded).logits.squeeze(-1)
        ours = _our_model(run_dir, tokenizer)(tokens[:2 * COMPARED], torch.zeros_like(tokens[:2 * COMPARED]))
    ours = ours[torch.arange(2 * COMPARED), at[:2 * COMPARED]]
    torch.testing.assert_close(theirs[:2 * COMPARED], ours, rtol=1e-5, atol=1e-5)
    accuracy = (theirs[0::2] > theirs[1::2]).float().mean().item()  # test.jsonl's pairs, held out from training
    print(f"test.jsonl pairwise accuracy {accuracy:.3f} over {TEST_PAIRS} pairs")
    assert accuracy >= 0.8, accuracy  # measured 0.89 (64 pairs)


def test_the_recipe_renders_the_trainer_and_is_sized_as_pairs(preference_data, tmp_path):  # noqa: F811
    from launcher import launch
    from launcher.estimator import estimate

    plan = launch.make_plan([f"base_results_dir={tmp_path / 'results'}", f"data_dir={preference_data}",
                             "cluster_type=slurm", "stages=[rlhf_rm,conversion]", "rlhf_rm=llama/tiny"],
                            dry_run=True, produced_by="test")
    assert plan.warnings == []
    scripts = launch.write(plan)
    assert "--stage rlhf_rm" in scripts[0].read_text()
    stage = plan.cfg["rlhf_rm"]
    assert stage["reward_model"]["center_rewards_coefficient"] is None  # TRL's default: no centering
    # The conversion exports the reward model's checkpoints (the launch's last trainer stage).
    assert plan.cfg["conversion"]["checkpoint_dir"] == str(tmp_path / "results" / "llama_tiny_rm" / "rlhf_rm" /
                                                           "checkpoints")
    # A pair is two rows through the model, as for alignment.
    result = estimate(stage, vocab_size=512, node_memory_bytes=64 * 2**30, stage="rlhf_rm")
    assert result.layout.micro_batch_size == 2 * stage["model"]["micro_batch_size"]


@pytest.mark.parametrize("arch", ["llama", "gpt"])  # an untied LM head, and one tied to the embedding
def test_starting_weights_skip_the_lm_head_and_keep_the_seeded_score_head(arch, tmp_path):
    from runtime.convert.hf import save_hf_directory
    from runtime.finetune import load_pretrained
    from runtime.models import build_model
    from tests.runtime_parallel import harness as H

    cfg = H.tiny_config(arch, num_layers=2)
    source = build_model(dataclasses.replace(cfg, seed=cfg.seed + 1))  # other values than the reward model's seed
    directory = save_hf_directory(tmp_path / "hf", source.state_dict(), cfg, None)
    model = build_reward_model(cfg)
    head = model.output.weight.detach().clone()
    load_pretrained(model, str(directory), score_head=True)
    assert torch.equal(model.output.weight, head) and model.output.weight.shape == (1, cfg.hidden_size)
    theirs = source.state_dict()
    for name, tensor in model.state_dict().items():
        if name != "output.weight":
            torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
