"""GRPO's reward from a reward model (grpo.reward_model, runtime/rl/reward_model.py): a reward model of known
weights (seeded, as the rlhf_rm stage starts one) saved as a checkpoint of ours with the config an rlhf_rm run
records, and as its Hugging Face sequence-classification export. The rl stage's rewards of completions equal the
reward model's own scores of the rows the rlhf_rm data path renders for the same (prompt, completion) pairs
(runtime/alignment/data.py build_preference_dataset from a preference file), within 1e-6: through rollout() in one
process, under tensor parallelism (2 real gloo ranks), and from the export. A launch refuses what cannot score: a
causal LM's checkpoint and a reward model of another vocabulary (grpo.reward with grpo.reward_model is a case of
tests/launcher/test_bad_input.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.alignment.data import build_preference_dataset
from runtime.alignment.reward import RewardObjective, build_reward_model, whole_sequence_rows
from runtime.checkpoint import write_full_checkpoint
from runtime.config import parse_model_config
from runtime.micro_batch import PreparedBatch
from runtime.models import build_model
from runtime.parallel import ParallelDims, Topology
from runtime.rl.data import load_prompts, read_prompts
from runtime.rl.grpo import GRPOConfig
from runtime.rl.reward_model import RewardModel, build_reward_model as build_scorer, reward_model_source, rewards_of
from runtime.rl.rollout import rollout
from runtime.rl.stage import decode_all
from runtime.rl.synthetic import write_demo
from runtime.schema.chat import ChatTokenizer
from tests.launcher.helpers import nxdt, refused
from tests.runtime_parallel.dist_utils import run_distributed

SEQ, PROMPT = 24, 16  # the reward model's rows and prompt limit (the demo's prompts are 10 tokens)
SHAPE = {"architecture": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "max_position_embeddings": 32, "encoder_seq_length": SEQ,
         "make_vocab_size_divisible_by": 4, "share_embeddings_and_output_weights": False, "init_method_std": 0.2}
# Completions as the policy's are decoded: words, nothing, a special token inside, the end-of-turn marker's text.
TEXTS = ["c a f", "", "a <|im_start|> b", "b b b b b b b b b b b b b b", "f"]


def _section(tokenizer: str, seed: int) -> dict:
    return {**SHAPE, "seed": seed, "tokenizer": {"library": "huggingface", "model": tokenizer}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The demo's prompts and tokenizer, a seeded reward model saved as our checkpoint (an rlhf_rm run's recorded
    config) and as its export: (work dir, tokenizer, prompt messages, reward model, checkpoint dir, export dir)."""
    from runtime.convert.reward import save_reward_hf_directory

    work = tmp_path_factory.mktemp("rm_reward")
    write_demo(work / "data" / "rl_demo", num_train=20, num_valid=5, num_test=5)
    tokenizer = str(work / "data" / "rl_demo" / "tokenizer.json")
    messages = [r.prompt for r in read_prompts([work / "data" / "rl_demo" / "train.jsonl"])]
    section = _section(tokenizer, seed=7)
    model = build_reward_model(parse_model_config(section, tokenizer)).eval()
    recorded = {"model": section, "reward_model": {"center_rewards_coefficient": None, "max_prompt_length": PROMPT,
                                                   "truncation_mode": "keep_start"}}
    write_full_checkpoint(str(work / "rm" / "checkpoints"), 5, model.state_dict(), config=recorded)
    export = save_reward_hf_directory(work / "rm_hf", model.state_dict(), model.cfg, tokenizer,
                                      pad_token_id=ChatTokenizer(tokenizer).pad_id)
    return work, tokenizer, messages, model, str(work / "rm" / "checkpoints"), str(export)


def reference(setup, pairs: list[tuple[list, str]]) -> torch.Tensor:
    """The reward model's own scores of the rows the rlhf_rm stage's data path renders for (prompt, completion):
    a preference file of them (the completion chosen), tokenized by build_preference_dataset. A preference file
    holds no empty response: an empty completion's entry is NaN (compared by close() as any value)."""
    work, tokenizer, _, model, _, _ = setup
    kept = [row for row, (_, text) in enumerate(pairs) if text.strip()]
    file = work / f"pairs_{abs(hash(tuple(t for _, t in pairs)))}.jsonl"
    file.write_text("".join(json.dumps({"prompt": pairs[row][0],
                                        "chosen": [{"role": "assistant", "content": pairs[row][1]}],
                                        "rejected": [{"role": "assistant", "content": pairs[row][1] + " x"}]}) + "\n"
                            for row in kept))
    dataset = build_preference_dataset([file], tokenizer, SEQ, max_prompt_length=PROMPT, cache_dir=work / "cache")
    assert len(dataset) == len(kept)
    chosen = torch.from_numpy(np.stack([dataset[i][0] for i in range(len(dataset))]))
    batch = whole_sequence_rows(PreparedBatch(chosen[:, 0], chosen[:, 1], chosen[:, 2].float()))
    out = torch.full((len(pairs),), float("nan"))
    with torch.no_grad():
        out[kept] = RewardObjective().rewards(model(batch.input_ids, batch.labels), batch)
    return out


def close(got, expected: torch.Tensor) -> None:
    """Within 1e-6 (relative, or absolute near 0) where the reference scored the row; finite everywhere."""
    got = torch.as_tensor(got, dtype=torch.float32)
    assert torch.isfinite(got).all() and torch.isfinite(expected).sum() >= len(expected) // 2
    known = torch.isfinite(expected)
    torch.testing.assert_close(got[known], expected[known], rtol=1e-6, atol=1e-6)


def _scorer(path: str, tokenizer: str, topo: Topology) -> RewardModel:
    source = reward_model_source(path, tokenizer, ChatTokenizer(tokenizer).tokenizer.get_vocab_size())
    return RewardModel(build_scorer(source, topo), source, ChatTokenizer(tokenizer), micro_batch_size=2)


def _one_process() -> Topology:
    return Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))


def test_the_rollouts_rewards_are_the_reward_models_scores_of_the_rendered_rows(setup):
    work, tokenizer, messages, _, checkpoints, _ = setup
    chat = ChatTokenizer(tokenizer)
    topo = _one_process()
    scorer = _scorer(checkpoints, tokenizer, topo)
    prompts = load_prompts([work / "data" / "rl_demo" / "train.jsonl"], chat)
    indices = [3, 0, 7]
    policy = build_model(parse_model_config(_section(tokenizer, seed=11), tokenizer)).eval()
    config = GRPOConfig(num_generations=4, max_completion_length=6)
    out = rollout(policy, [prompts.prompts[i] for i in indices], [prompts.answers[i] for i in indices],
                  config=config, reward=scorer.reward(messages), decode=lambda ids: decode_all(chat, ids),
                  stop_ids=chat.stop_ids, topo=topo, seed=5, prompt_indices=indices, micro_batch_size=4,
                  pad_id=chat.pad_id, vocab_size=chat.tokenizer.get_vocab_size())
    expected = reference(setup, [(messages[indices[row // 4]], text) for row, text in enumerate(out.texts)])
    assert len(set(out.texts)) > 1 and out.table.rewards.std() > 0  # different completions, different scores
    close(out.table.rewards.cpu(), expected)
    # The same through the reward call the held-out evaluation makes, on texts of every kind.
    got = rewards_of(scorer.reward(messages), TEXTS, [""] * len(TEXTS), [1, 2, 3, 4, 5])
    close(got, reference(setup, list(zip(messages[1:6], TEXTS))))


def _tp2(checkpoints: str, tokenizer: str, messages: list) -> list[float]:
    topo = Topology.build(ParallelDims(tp=2, pp=1, dp=1, world_size=2))
    return rewards_of(_scorer(checkpoints, tokenizer, topo).reward(messages), TEXTS, [""] * len(TEXTS),
                      [0, 1, 2, 3, 4])


def test_tensor_parallel_ranks_score_as_one_process(setup):
    _, tokenizer, messages, _, checkpoints, _ = setup
    expected = reference(setup, list(zip(messages[:5], TEXTS)))
    for got in run_distributed(_tp2, world_size=2, args=(checkpoints, tokenizer, messages)):
        close(got, expected)


def test_the_hugging_face_export_scores_as_the_checkpoint(setup):
    _, tokenizer, messages, _, _, export = setup
    # An export records no row length: rows are cut at its max_position_embeddings (32), not the run's SEQ, so the
    # completion too long for SEQ is left out.
    texts = [text for text in TEXTS if len(text) < 20]
    got = rewards_of(_scorer(export, tokenizer, _one_process()).reward(messages), texts, [""] * len(texts),
                     list(range(len(texts))))
    close(got, reference(setup, list(zip(messages, texts))))


def _launch(work, *overrides: str):
    return nxdt(f"base_results_dir={work}/results", f"data_dir={work}/data", "cluster_type=local", "stages=[rl]",
                "rl=demo", "rl.grpo.reward=null", *overrides, cwd=work)


def test_a_launch_refuses_a_causal_lm_and_a_reward_model_of_another_vocabulary(setup):
    work, tokenizer, _, _, checkpoints, _ = setup
    policy = build_model(parse_model_config(_section(tokenizer, seed=11), tokenizer))
    causal = write_full_checkpoint(str(work / "lm" / "checkpoints"), 3, policy.state_dict(),
                                   config={"model": _section(tokenizer, seed=11)})
    other = work / "rm_other_vocab"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                   "model_type": "llama", "num_labels": 1, "vocab_size": 64}))
    before = sorted(work.rglob("*"))
    refused(_launch(work, f"+rl.grpo.reward_model={causal}"),
            f"rl.grpo.reward_model: {causal} is not a reward model (no score head); train one with stages=[rlhf_rm]")
    refused(_launch(work, f"+rl.grpo.reward_model={other}"),
            f"rl.grpo.reward_model: {other} is a reward model of another vocabulary: 64 tokens, but the rl stage's "
            f"tokenizer (model.tokenizer.model) has 20")
    refused(_launch(work, f"+rl.grpo.reward_model={work}/nowhere"),
            f"rl.grpo.reward_model: {work}/nowhere does not exist")
    assert sorted(work.rglob("*")) == before, "a rejected launch wrote files"
    # The rlhf_rm run's checkpoints pass (a dry run renders the stage).
    result = _launch(work, f"+rl.grpo.reward_model={checkpoints}", "--dry-run")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_rl_stage_trains_and_validates_on_the_reward_models_scores(setup):
    """rl=demo rendered with the reward model (two data-parallel ranks, each scoring its own rows): every step logs
    the rollouts' mean score, and validation the held-out prompts' (runtime/rl/trainer.py build_rl)."""
    from tests.checkpoint.launch_helpers import train_rendered

    work, _, _, _, checkpoints, _ = setup
    result = _launch(work, f"+rl.grpo.reward_model={checkpoints}", "rl.trainer.max_steps=2",
                     "rl.trainer.val_check_interval=2", "rl.trainer.limit_val_batches=1", "rl.trainer.preflight=false",
                     "rl.exp_manager.create_tensorboard_logger=false", "rl.exp_manager.create_metrics_plot=false",
                     "rl.trainer.log_every_n_steps=1", "--dry-run")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    stage = work / "results" / "rl_demo" / "rl"
    assert set(train_rendered(stage / "rl_config.yaml", "rl")) == {0}
    rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines() if line]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2] and all(row["reward_std"] > 0 for row in steps), steps
    held_out = [row for row in rows if "val_reward" in row]
    assert len(held_out) == 1 and np.isfinite(held_out[0]["val_reward"]), rows
