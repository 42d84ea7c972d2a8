"""The rl demo end to end in one process: its data (runtime/rl/synthetic.py, written by the data_preparation stage
as input.source synthetic_prompts), the prompt records and their per-step order (runtime/rl/data.py), and GRPO from
random init through RolloutBatches and the plain train_step (runtime/rl/stage.py) raising the held-out greedy
reward."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.models import ModelConfig, build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
from runtime.rl.data import PromptBatches, PromptSet, load_prompts, read_prompts
from runtime.rl.grpo import GRPOConfig
from runtime.rl.rewards import prefix_match
from runtime.rl.stage import RolloutBatches, greedy_reward
from runtime.rl.synthetic import make_splits, write_demo
from runtime.schema.chat import ChatTokenizer
from runtime.step import train_step

DEMO = {"num_train": 600, "num_valid": 100, "num_test": 100, "seed": 1234, "num_symbols": 10, "symbols_per_prompt": 3}
FILES = ("train.jsonl", "valid.jsonl", "test.jsonl", "tokenizer.json", "tokenizer_config.json", "summary.json")
# The learning run: the demo's settings (runtime/rl/synthetic.py's docstring), stopped at step 100 of its 200, where
# model seeds 0-3 measured a held-out greedy reward of 0.36-0.42 (from 0.00-0.03), in about 25 s on one core.
STEPS, PROMPTS_PER_STEP, LR, EVAL_EVERY, HELD_OUT = 100, 32, 1e-3, 50, 50
GRPO = GRPOConfig(num_generations=8, max_completion_length=4, temperature=1.0, beta=0.0)
ONE = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_demo")
    assert write_demo(out, **DEMO) is True
    return out


def _records(out, split):
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_demo_prompts_are_disjoint_exact_and_one_token_per_symbol(demo, tmp_path):
    prompts = {split: [r["prompt"] for r in _records(demo, split)] for split in ("train", "valid", "test")}
    for split, items in prompts.items():
        assert len(items) == len(set(items)) == DEMO[f"num_{split}"]
    assert not set(prompts["test"]) & (set(prompts["train"]) | set(prompts["valid"]))
    assert not set(prompts["train"]) & set(prompts["valid"])
    for record in _records(demo, "train"):
        head, _, symbols = record["prompt"].partition(": ")
        assert head == "repeat" and record["answer"] == symbols and len(symbols.split()) == 3
    assert sorted(p.name for p in demo.iterdir()) == sorted(FILES)
    assert write_demo(demo, **DEMO) is False  # already written
    assert make_splits(50, 10, 20, 3)["test"] == make_splits(500, 10, 20, 3)["test"]
    assert write_demo(tmp_path, **DEMO) and all((tmp_path / f).read_bytes() == (demo / f).read_bytes() for f in FILES)
    with pytest.raises(ValueError, match="more than the 100 distinct prompts"):
        make_splits(90, 10, 10, 1, num_symbols=10, symbols_per_prompt=2)
    chat = ChatTokenizer(demo)
    ids = chat.prompt_ids([{"role": "user", "content": "repeat: c a f"}])
    assert [chat.tokenizer.id_to_token(i) for i in ids] == ["<|im_start|>", "user", "repeat", ":", "c", "a", "f",
                                                             "<|im_end|>", "<|im_start|>", "assistant"]
    assert chat.stop_ids == {chat.tokenizer.token_to_id("<|im_end|>")}
    assert chat.pad_id == chat.tokenizer.token_to_id("<|pad|>")


def test_prefix_match_credits_right_words_from_the_start():
    assert prefix_match("c a f", "c a f") == 1.0
    assert prefix_match(" c  a f ", "c a f") == 1.0
    assert prefix_match("c a x", "c a f") == pytest.approx(2 / 3)
    assert prefix_match("c a f g", "c a f") == pytest.approx(3 / 4)
    assert prefix_match("c", "c a f") == pytest.approx(1 / 3)
    assert prefix_match("x a f", "c a f") == 0.0
    assert prefix_match("c <|pad|>", "c") == 0.5  # what the rl stage's decoding leaves of a padded answer
    assert prefix_match("", "") == 1.0 and prefix_match("", "c") == 0.0


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "repeat: a"}', "x.jsonl:2: the record has no 'answer'"),
    ('{"prompt": "repeat: a", "answer": 3}', "x.jsonl:2: 'answer' is of type int"),
    ('{"answer": "a"}', "x.jsonl:2: the record has no 'prompt'"),
    ('{"prompt": "", "answer": "a"}', "x.jsonl:2: prompt is empty"),
    ('{"prompt": [{"role": "assistant", "content": "hi"}], "answer": "a"}',
     "x.jsonl:2: the prompt ends with a assistant message"),
    ('{"prompt": "repeat: a", "answer": "a"', "x.jsonl:2: not valid JSON"),
    ('["repeat: a"]', "x.jsonl:2: a record must be a JSON object, not list"),
])
def test_bad_records_are_one_line_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "repeat: b", "answer": "b"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as error:
        read_prompts([path])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_records_without_answers_for_a_reward_that_needs_none(tmp_path, demo):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "repeat: b"}\n{"prompt": [{"role": "system", "content": "a"}, '
                    '{"role": "user", "content": "repeat: c"}], "answer": "c"}\n', encoding="utf-8")
    assert [r.answer for r in read_prompts([path], needs_answer=False)] == ["", "c"]
    chat = ChatTokenizer(demo)
    assert load_prompts([path], chat, needs_answer=False).answers == ["", "c"]
    with pytest.raises(ValueError, match=r"x.jsonl:2: the prompt has 12 tokens .* more than max_prompt_length 11"):
        load_prompts([path], chat, needs_answer=False, max_prompt_length=11)
    with pytest.raises(ValueError, match="rl.data.train_files: no prompt files"):
        read_prompts([])


def _prompt_set(n: int) -> PromptSet:
    return PromptSet([[i] for i in range(n)], [str(i) for i in range(n)], [f"f:{i + 1}" for i in range(n)])


def test_prompt_batches_resume_exactly_and_every_dp_size_reads_the_same_prompts():
    data = _prompt_set(10)
    one = PromptBatches(data, 4, seed=7)
    steps = [one.next_batch() for _ in range(5)]  # 20 samples: two epochs, each a permutation of all 10
    order = [i for step in steps for i in step.indices]
    assert sorted(order[:10]) == sorted(order[10:]) == list(range(10)) and order[:10] != order[10:]
    assert [s.step for s in steps] == [0, 1, 2, 3, 4] and steps[1].answers == [str(i) for i in steps[1].indices]
    assert PromptBatches(data, 4, seed=8).next_batch().indices != steps[0].indices
    halves = [PromptBatches(data, 4, seed=7, dp_rank=r, dp_size=2) for r in (0, 1)]
    for step in steps:
        mine = [h.next_batch() for h in halves]
        assert mine[0].indices + mine[1].indices == step.indices and mine[0].step == step.step
    resumed = PromptBatches(data, 4, seed=7)
    first = PromptBatches(data, 4, seed=7)
    first.next_batch(), first.next_batch()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint stores it
    assert resumed.next_batch() == first.next_batch() == steps[2]
    with pytest.raises(ValueError, match="prompts_per_step: 3 must be a positive multiple of the data-parallel"):
        PromptBatches(data, 3, seed=0, dp_rank=0, dp_size=2)


def _model(vocab_size: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=32, rotary_base=10000.0,
                      init_method_std=0.02, seed=seed)
    return parallelize_model(build_model(cfg), ONE, data_parallel=DataParallelConfig("fp32", False))


def _rollouts(chat, train, model, seed=0, prompts_per_step=PROMPTS_PER_STEP, config=GRPO):
    return RolloutBatches(PromptBatches(train, prompts_per_step, seed=seed), model, config=config,
                          reward=prefix_match, chat=chat, topo=ONE, seed=seed,
                          micro_batch_size=prompts_per_step * config.num_generations)


def test_rollout_batches_resume_draws_what_the_run_drew(demo):
    chat = ChatTokenizer(demo)
    train = load_prompts([demo / "train.jsonl"], chat)
    model = _model(chat.tokenizer.get_vocab_size(), 0)
    run = _rollouts(chat, train, model, prompts_per_step=4)
    run.next_batch()
    state = run.state_dict()
    batches = run.next_batch()
    resumed = _rollouts(chat, train, model, prompts_per_step=4)
    resumed.load_state_dict(state)
    again = resumed.next_batch()
    assert resumed.last.completions == run.last.completions and resumed.last.texts == run.last.texts
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again))
    assert resumed.objective.current.table is resumed.last.table
    assert set(run.metrics) >= {"reward_std", "frac_reward_zero_std", "truncated_ratio", "rollout_time_s"}


def test_grpo_from_random_init_raises_the_held_out_greedy_reward(demo):
    """STEPS steps of GRPO on the plain train_step: the greedy reward on held-out prompts goes from a random
    model's (under 0.1) to several times that."""
    chat = ChatTokenizer(demo)
    train = load_prompts([demo / "train.jsonl"], chat)
    valid = load_prompts([demo / "valid.jsonl"], chat, limit=HELD_OUT)
    model = _model(chat.tokenizer.get_vocab_size(), 0)
    optimizer = ShardedAdamW(model, {"lr": LR, "weight_decay": 0.0, "betas": [0.9, 0.99], "eps": 1e-8})
    batches = _rollouts(chat, train, model)

    def held_out() -> float:
        return greedy_reward(model, valid, reward=prefix_match, chat=chat,
                             max_new_tokens=GRPO.max_completion_length)["eval_reward"]

    curve = [held_out()]
    rewards = []
    for step in range(1, STEPS + 1):
        result = train_step(model, optimizer, batches.next_batch(), ONE, lr=LR, clip=1.0, objective=batches.objective)
        rewards.append(result.metrics["reward"])
        if step % EVAL_EVERY == 0:
            curve.append(held_out())
    print("held-out greedy reward every", EVAL_EVERY, "steps:", [round(r, 3) for r in curve])
    assert curve[0] < 0.1, curve
    assert curve[-1] > 0.25 and curve[-1] > curve[0] + 0.2, curve
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1, (rewards[:10], rewards[-10:])


def test_data_preparation_stage_writes_the_rl_demo(tmp_path):
    from launcher.compose import compose, resolve
    from runtime.data_prep.plan import check_inputs, count_tasks
    from runtime.data_prep.run import run_task
    from runtime.schema.data_preparation import UserError, parse_config

    stage = resolve(compose([f"data_dir={tmp_path}", "data_preparation=rl_demo"]))["data_preparation"]
    assert stage["synthetic_prompts"] == {"num_train": 600, "num_valid": 100, "num_test": 200, "seed": 1234,
                                          "num_symbols": 10, "symbols_per_prompt": 3}
    stage["synthetic_prompts"].update(num_train=40, num_valid=10, num_test=10)
    assert count_tasks(stage) == 1 and check_inputs(stage) == []
    cfg = parse_config(stage)
    assert run_task(cfg, 1, 2) is False  # task 0 writes it alone
    assert run_task(cfg, 0, 1) is True
    out = tmp_path / "rl_demo"
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES) and len(_records(out, "train")) == 40
    for change, message in (({"num_symbols": 27}, "data_preparation.synthetic_prompts.num_symbols: 27"),
                            ({"vocab_size": 512}, "data_preparation.synthetic_prompts.vocab_size: unknown key")):
        bad = json.loads(json.dumps(stage))
        bad["synthetic_prompts"].update(change)
        with pytest.raises(UserError) as error:
            parse_config(bad)
        assert any(message in problem for problem in error.value.problems), error.value.problems
    stage["synthetic_prompts"].update(num_train=2000)
    with pytest.raises(UserError, match="synthetic_prompts: num_train \\+ num_valid \\+ num_test = 2020 is more"):
        run_task(parse_config(stage), 0, 1)
