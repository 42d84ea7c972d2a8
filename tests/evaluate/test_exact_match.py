"""The exact_match task through the evaluation stage's entry point, on tiny Llama checkpoints written here.

The references are made from the models' own answers: each checkpoint's greedy completion of a prompt is worked
out here by re-running the full forward per token (not runtime/generate.py), from a prompt rendered with the
plain ChatML formula (not runtime/schema/chat.py), and written into the chat file as the answer of some records and
not others; so the expected scores are known by counting. Covers the baseline (random init, and a run's
model.restore_from_path), a LoRA checkpoint that holds only its adapters, and one-line errors for bad input.
"""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from runtime.checkpoint import write_full_checkpoint
from runtime.config import parse_model_config
from runtime.evaluate.__main__ import main
from runtime.models import build_model
from runtime.models.lora import apply_lora
from runtime.sft.synthetic import write_demo
from tests.sft.chatml import render_chatml
from runtime.schema.training_config import LoraConfig

NEW = 6
MODEL = {"architecture": "llama", "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "max_position_embeddings": 96, "encoder_seq_length": 96, "seed": 7,
         "init_method_std": 0.1}
LORA = {"peft_scheme": "lora", "lora_rank": 4, "lora_alpha": 8.0, "target_modules": ["qkv_proj", "o_proj"]}


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The synthetic SFT set's tokenizer (ChatML, <|im_end|> ends a turn) and its first test prompts."""
    out = tmp_path_factory.mktemp("sft_demo")
    write_demo(out, num_train=40, num_valid=2, num_test=6, vocab_size=300, seed=3)
    records = [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]
    return out, [r["messages"][:-1] for r in records]


class Reference:
    """Greedy completions by the full forward per token, decoded as the task decodes them."""

    def __init__(self, tokenizer_json):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.stop = self.tokenizer.token_to_id("<|im_end|>")
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @torch.no_grad()
    def answer(self, model, messages) -> str:
        ids = self.tokenizer.encode(render_chatml(messages, add_generation_prompt=True), add_special_tokens=False).ids
        new = []
        for _ in range(NEW):
            token = int(model(torch.tensor([ids + new]))[0, -1, :self.vocab].argmax())
            if token == self.stop:
                break
            new.append(token)
        return self.tokenizer.decode(new, skip_special_tokens=True)


def model_section(demo_dir, **extra) -> dict:
    tokenizer = str(demo_dir / "tokenizer.json")
    return {**MODEL, "tokenizer": {"library": "huggingface", "model": tokenizer}, **extra}


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    """Weights unlike the random init's (a stand-in for training)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.1 * torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def chat_file(path, prompts, answers) -> str:
    path.write_text("".join(json.dumps({"messages": [*m, {"role": "assistant", "content": a}]}) + "\n"
                            for m, a in zip(prompts, answers)))
    return str(path)


def evaluate(tmp_path, checkpoints, task: dict, capsys, **evaluation) -> tuple[int, dict | None, str]:
    config = {"run": {"results_dir": str(tmp_path / "evaluation")}, "trainer": {"devices": 1, "accelerator": "cpu"},
              "model": {}, "checkpoint_dir": str(checkpoints), "micro_batch_size": 4,
              "tasks": [{"name": "em", "type": "exact_match", "max_new_tokens": NEW, **task}], **evaluation}
    path = tmp_path / "evaluation_config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["--config", str(path)])
    captured = capsys.readouterr()
    results = tmp_path / "evaluation" / "results.json"
    return code, (json.loads(results.read_text()) if code == 0 else None), captured.out + captured.err


def test_scores_count_exact_answers_after_and_before(demo, tmp_path, capsys):
    demo_dir, prompts = demo
    section = model_section(demo_dir)
    cfg = parse_model_config(section, section["tokenizer"]["model"])
    init = build_model(cfg)  # what step 0 of a run without restore_from_path trained from
    state = perturbed(init, 1)
    trained = build_model(cfg)
    trained.load_state_dict(state, strict=False)
    write_full_checkpoint(str(tmp_path / "checkpoints"), 10, state, config={"model": section})
    reference = Reference(demo_dir / "tokenizer.json")
    after = [reference.answer(trained, m) for m in prompts]
    before = [reference.answer(init, m) for m in prompts]
    assert all(a.strip() and a.strip() != b.strip() for a, b in zip(after, before))
    # Right after training: records 0-2 (record 1 with whitespace around it, which does not count); right before:
    # record 3; neither: 4 and 5.
    answers = [after[0], f"  {after[1]}\n", after[2], before[3], "no such answer", after[5] + "!"]
    path = chat_file(tmp_path / "chat.jsonl", prompts, answers)

    code, results, log = evaluate(tmp_path, tmp_path / "checkpoints", {"path": path, "baseline": True}, capsys)
    assert code == 0, log
    (result,) = results["tasks"]
    assert result["task"] == "em" and result["type"] == "exact_match" and result["num_examples"] == 6
    assert result["exact_match"] == pytest.approx(3 / 6)
    assert result["baseline_exact_match"] == pytest.approx(1 / 6)
    assert result["exact_match_stderr"] == pytest.approx((0.5 * 0.5 * 6 / 5 / 6) ** 0.5)
    assert result["baseline"] == "random init (model.seed 7)"
    assert "baseline: random init (model.seed 7)" in log and "baseline_exact_match" in log  # the table shows both
    rows = [json.loads(line) for line in (tmp_path / "evaluation/tasks/em.completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows] == after and [r["baseline_completion"] for r in rows] == before
    assert [r["correct"] for r in rows] == [True, True, True, False, False, False]

    # limit keeps the first records; without baseline the starting weights are never built.
    code, results, log = evaluate(tmp_path, tmp_path / "checkpoints", {"path": path, "limit": 2}, capsys)
    assert code == 0, log
    assert results["tasks"][0]["exact_match"] == 1.0 and "baseline_exact_match" not in results["tasks"][0]
    assert "baseline:" not in log


def test_baseline_is_restore_from_path_and_a_lora_checkpoint_loads_its_base(demo, tmp_path, capsys):
    """A LoRA run from a checkpoint of ours: its checkpoint holds only the adapters; the evaluation rebuilds the
    base from model.restore_from_path, adds them, and the baseline is that base."""
    demo_dir, prompts = demo
    section = model_section(demo_dir)
    cfg = parse_model_config(section, section["tokenizer"]["model"])
    base = build_model(cfg)
    base.load_state_dict(perturbed(base, 2), strict=False)
    base_location = write_full_checkpoint(str(tmp_path / "base"), 50, dict(base.named_parameters()),
                                          config={"model": section})
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    tuned = apply_lora(build_model(cfg), lora, seed=7)
    tuned.load_state_dict(dict(base.named_parameters()), strict=False)
    gen = torch.Generator().manual_seed(4)
    adapters = {}
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if ".lora." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
                adapters[name] = param.detach().clone()
    run = model_section(demo_dir, restore_from_path=base_location, peft=LORA)
    write_full_checkpoint(str(tmp_path / "checkpoints"), 20, adapters, config={"model": run})
    reference = Reference(demo_dir / "tokenizer.json")
    after = [reference.answer(tuned, m) for m in prompts]
    before = [reference.answer(base, m) for m in prompts]
    assert all(a != b for a, b in zip(after, before))
    path = chat_file(tmp_path / "chat.jsonl", prompts, after[:4] + before[4:])

    code, results, log = evaluate(tmp_path, tmp_path / "checkpoints", {"path": path, "baseline": True}, capsys)
    assert code == 0, log
    result = results["tasks"][0]
    assert result["exact_match"] == pytest.approx(4 / 6) and result["baseline_exact_match"] == pytest.approx(2 / 6)
    assert result["baseline"] == f"model.restore_from_path {base_location}"


def test_bad_input_is_one_line_naming_the_place(demo, tmp_path, capsys):
    demo_dir, prompts = demo
    # Nothing is loaded before the tasks are checked: no checkpoint is needed to see these errors.
    missing = tmp_path / "nowhere.jsonl"
    code, _, log = evaluate(tmp_path, tmp_path / "no_checkpoints", {"path": str(missing)}, capsys)
    assert code == 2
    assert log.strip() == (f"error: tasks[em].path: no such file {str(missing)!r}; write chat records there (for "
                           f"the demo: python -m runtime.sft.synthetic --output-dir <dir>)")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [*prompts[0], {"role": "assistant", "content": "x"}]}) + "\n"
                   + json.dumps({"messages": prompts[1]}) + "\n")
    code, _, log = evaluate(tmp_path, tmp_path / "no_checkpoints", {"path": str(bad)}, capsys)
    assert code == 2
    assert log.strip().splitlines() == [f"error: {bad}:2: the record has no assistant message, so nothing to learn "
                                        "from; add one or remove the record"]

    code, _, log = evaluate(tmp_path, tmp_path / "no_checkpoints", {"path": str(bad), "max_new_tokens": 0,
                                                                     "baseline": "yes"}, capsys,
                            trainer={"devices": 2}, model={"pipeline_model_parallel_size": 2})
    assert code == 2
    assert log.strip().splitlines() == [
        "error: evaluation.tasks[0].max_new_tokens: 0 must be a positive integer",
        "error: evaluation.tasks[0].baseline: 'yes' is not true or false"]
    code, _, log = evaluate(tmp_path, tmp_path / "no_checkpoints", {"path": str(bad)}, capsys,
                            trainer={"devices": 2}, model={"pipeline_model_parallel_size": 2})
    assert code == 2 and "exact_match) generates text, which runs at pipeline_model_parallel_size 1 only" in log
