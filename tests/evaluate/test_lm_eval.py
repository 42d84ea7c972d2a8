"""Our lm-eval backend (runtime/evaluate/harness.py) against lm-eval's own `hf` backend on the checkpoint's Hugging Face
export, on local task files: the same accuracy and exact match, log-likelihoods within 1e-4, the same generations;
the same at tp=2, pp=2 and dp=2. Word perplexity through loglikelihood_rolling against the trainer's own loss path.

The model: a tiny GPT trained to count (w3 w5 w7 ... in strides of 1 to 3, modulo 64), so it answers the tasks
well enough that agreeing means agreeing on right and wrong answers alike.
"""
import json
import math

import numpy as np
import pytest
import torch

from runtime.evaluate import harness, lm_tasks
from tests.checkpoint.launch_helpers import convert_rendered, train_rendered, training_overrides
from tests.launcher.helpers import nxdt
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_train.helpers import write_mmidx

WORDS = 64
TASKS = ["count_mc", "count_gen"]
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # (tp, pp) on two ranks; the rest is data parallel


def _counting(start: int, stride: int, length: int) -> list[int]:
    return [(start + stride * i) % WORDS for i in range(length)]


def _text(numbers) -> str:
    return " ".join(f"w{n}" for n in numbers)


def _corpus(directory):
    """A word-level tokenizer with an end-of-text token (the export's eos, lm-eval's eot), and counting documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([_text(range(WORDS))], trainer=trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<|endoftext|>"], min_frequency=1))
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    rng = np.random.default_rng(0)
    docs = [[tokenizer.token_to_id(f"w{n}") for n in _counting(int(rng.integers(WORDS)), int(rng.choice((1, 2, 3))),
                                                                int(rng.integers(60, 200)))] for _ in range(400)]
    write_mmidx(directory / "count", docs)
    return directory


def _tasks(directory):
    """Local lm-eval task files: a multiple choice (the next number, or the next at another stride) and a generation
    (the next four numbers, cut at the stop string w0, which counting past 63 reaches). Contexts of 1 to 6 numbers:
    from one number the stride is a guess, so the model gets some wrong, and the backends must agree on those too."""
    rng = np.random.default_rng(1)
    mc, gen = [], []
    for _ in range(24):
        start, stride, known = int(rng.integers(WORDS)), int(rng.choice((1, 2, 3))), int(rng.integers(1, 7))
        seq = _counting(start, stride, known + 4)
        last = seq[known - 1]
        choices = [f"w{(last + s) % WORDS}" for s in (stride, stride % 3 + 1, (stride + 1) % 3 + 1)]
        gold = int(rng.integers(3))
        choices[0], choices[gold] = choices[gold], choices[0]
        mc.append({"question": _text(seq[:known]), "choices": choices, "answer": gold})
        gen.append({"question": _text(seq[:known]), "answer": _text(seq[known:]).split(" w0")[0]})
    directory.mkdir()
    for name, docs in (("mc", mc), ("gen", gen)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / "count_mc.yaml").write_text(f"""
task: count_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {directory}/mc.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}},
              {{metric: acc_norm, aggregation: mean, higher_is_better: true}}]
""")
    (directory / "count_gen.yaml").write_text(f"""
task: count_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {directory}/gen.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: [" w0"], max_gen_toks: 4, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""")
    return directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint directory, Hugging Face export, task folder)."""
    root = tmp_path_factory.mktemp("lm_eval")
    data = _corpus(root / "data")
    train = training_overrides(data, root / "results", steps=60, every=60,
                               extra=("training.model.optim.lr=3e-3", "training.trainer.devices=1"))
    result = nxdt("cluster_type=local", *train, "--dry-run", cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stage = root / "results" / "gpt3_tiny"
    assert train_rendered(stage / "training" / "training_config.yaml") == [0]
    convert = [o.replace("stages=[training]", "stages=[conversion]") for o in train]
    convert_rendered(convert, root, stage / "conversion")
    return str(stage / "training" / "checkpoints"), str(stage / "conversion" / "hf_model"), _tasks(root / "tasks")


def _ours(checkpoints: str, task_dir, tp: int = 1, pp: int = 1, *, leave: bool = False) -> dict:
    """Our backend at tp x pp. leave: in the test process, leave the one-process world init_device joined, so that
    a later run_distributed in this process can still fork its ranks (it spawns fresh interpreters where the test
    process holds a world)."""
    from runtime.device import init_device, shutdown
    from runtime.evaluate.model import load_model

    device = init_device("cpu")
    try:
        loaded = load_model(checkpoints, None, tp=tp, pp=pp, vpp=None, device=device)
        lm = harness.RuntimeLM(loaded, device, tokenizer_path=loaded.training["model"]["tokenizer"]["model"],
                               batch_size=5, max_length=64)
        output = harness.run(lm, TASKS, task_manager=lm_tasks.task_manager(str(task_dir), defaults=False),
                             num_fewshot=None, limit=None, apply_chat_template=False, fewshot_as_multiturn=False,
                             bootstrap_iters=0, log_samples=True)
    finally:
        if leave:
            shutdown(device)
    return {"results": output["results"], "samples": output["samples"]}


def _every_layout(checkpoints: str, task_dir) -> dict:
    """Each two-rank layout in turn, in one world (rank 0's answers)."""
    import torch.distributed as dist

    out = {name: _ours(checkpoints, task_dir, tp, pp) for name, (tp, pp) in LAYOUTS.items()}
    return out if dist.get_rank() == 0 else None


def _hf(export: str, task_dir) -> dict:
    import lm_eval

    output = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": export, "dtype": "float32", "max_length": 64, "device": "cpu"},
        tasks=TASKS, task_manager=lm_tasks.task_manager(str(task_dir), defaults=False), batch_size=5,
        bootstrap_iters=0, log_samples=True)
    return {"results": output["results"], "samples": output["samples"]}


def _metrics(run: dict, task: str) -> dict:
    return {k: v for k, v in run["results"][task].items() if "stderr" not in k and k != "alias"}


@pytest.mark.long("trains and exports a counting GPT, then scores it with our backend at four layouts (one process "
                  "and two ranks) and with lm-eval's hf backend on the export")
def test_our_backend_scores_what_the_hf_backend_scores_on_the_export_under_any_layout(trained):
    checkpoints, export, task_dir = trained
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # In this order: the hf backend imports lm-eval's evaluator and datasets here, which the two ranks forked next
        # inherit (instead of importing them each); the one-process run joins a world, so it comes after the fork.
        reference = _hf(export, task_dir)
        runs = run_distributed(_every_layout, 2, args=(checkpoints, task_dir))[0]
        runs["tp1"] = _ours(checkpoints, task_dir, leave=True)
    finally:
        torch.set_num_threads(threads)
    # The model counts, and misses where one number leaves the stride open: agreement on right and wrong answers.
    assert 0.5 < _metrics(reference, "count_mc")["acc,none"] < 1
    assert 0.3 < _metrics(reference, "count_gen")["exact_match,none"] < 1
    for name, run in runs.items():
        for task in TASKS:
            assert _metrics(run, task) == _metrics(reference, task), (name, task)
        for ours, theirs in zip(run["samples"]["count_mc"], reference["samples"]["count_mc"], strict=True):
            assert ours["target"] == theirs["target"]
            for (loglik, greedy), (want, want_greedy) in zip((r[0] for r in ours["resps"]),
                                                              (r[0] for r in theirs["resps"]), strict=True):
                assert abs(loglik - want) < 1e-4 and greedy == want_greedy, (name, ours["doc"])
        generations = [s["resps"][0][0] for s in run["samples"]["count_gen"]]
        assert generations == [s["resps"][0][0] for s in reference["samples"]["count_gen"]], name
    # The stop string " w0" cut a counting answer short, and the cut answer is right (the targets are cut there too).
    cut = [s for s in reference["samples"]["count_gen"] if len(s["target"].split()) < 4]
    assert cut and any(s["resps"][0][0] == s["target"] for s in cut)


@pytest.mark.long("scores local text through lm-eval's rolling windows with our backend, and the same windows "
                  "through the trainer's loss path")
def test_word_perplexity_equals_the_trainer_loss_path_on_the_same_text(trained, tmp_path, request):
    """loglikelihood_rolling (lm-eval's disjoint windows of 64, the first after the prefix token) summed into
    word_perplexity by lm-eval, against the same windows' token losses from runtime.step.eval_step, the path the
    stage's validation_loss takes, turned into the same per-word figure."""
    from lm_eval import utils as lm_utils

    from runtime.device import init_device, shutdown
    from runtime.evaluate.model import load_model
    from runtime.evaluate.tasks import load_task, write_normalized
    from runtime.micro_batch import MicroBatch
    from runtime.step import eval_step

    checkpoints = trained[0]
    texts = [_text(_counting(start, stride, length)) for start, stride, length in
             ((3, 1, 150), (60, 2, 90), (7, 3, 40), (11, 1, 64))]  # over, under and at the window
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task = load_task({"name": "count_text", "type": "perplexity", "path": str(tmp_path / "docs.jsonl")})
    device = init_device("cpu")
    request.addfinalizer(lambda: shutdown(device))  # leave the world: later tests here fork their ranks (see _ours)
    loaded = load_model(checkpoints, None, tp=1, pp=1, vpp=None, device=device)
    lm = harness.RuntimeLM(loaded, device, tokenizer_path=loaded.training["model"]["tokenizer"]["model"],
                           batch_size=3, max_length=64)
    config = lm_tasks.local_task("count_text", "perplexity", write_normalized(task, tmp_path / "norm.jsonl"))
    output = harness.run(lm, [config], task_manager=lm_tasks.task_manager(None, defaults=False), num_fewshot=None,
                         limit=None, apply_chat_template=False, fewshot_as_multiturn=False, bootstrap_iters=0)
    [row] = harness.result_rows(output)

    batches, tokens = [], 0
    for text in texts:
        for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=64, context_len=1)):
            window = torch.tensor([context + continuation])
            mask = torch.zeros(1, window.shape[1] - 1)
            mask[:, -len(continuation):] = 1.0
            batches.append(MicroBatch(window[:, :-1], window[:, 1:], mask))
            tokens += len(continuation)
    assert len(batches) > len(texts)  # some documents span several windows
    nll = eval_step(loaded.model, batches, loaded.topo) * tokens  # token-weighted mean over every window
    words = sum(len(text.split()) for text in texts)
    assert row["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-5)


HISTORIES = [
    ([{"role": "user", "content": "reverse: a b"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add: 1 + 2"},
      {"role": "assistant", "content": "3"}, {"role": "user", "content": "add: 2 + 2"}], True),  # few-shot as turns
    ([{"role": "user", "content": "sort: 3 1"}, {"role": "assistant", "content": "1 "}], False),  # continue the reply
]


@pytest.mark.parametrize("history, add_generation_prompt", HISTORIES)
def test_chat_prompts_render_as_transformers_renders_them_for_the_hf_backend(tmp_path, history,
                                                                             add_generation_prompt):
    from transformers import AutoTokenizer

    from runtime.schema.chat import ChatTokenizer
    from runtime.sft.synthetic import tokenizer_config, train_tokenizer

    text = train_tokenizer(["reverse sort add brief " * 20, "0 1 2 3 4 5 6 7 8 9"], vocab_size=300)
    (tmp_path / "tokenizer.json").write_text(text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(text)))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        history, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=not add_generation_prompt)
    assert harness.render_chat(ChatTokenizer(tmp_path / "tokenizer.json"), history, add_generation_prompt) == theirs
