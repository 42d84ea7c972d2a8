"""Requests per second of our lm-eval backend (runtime.evaluate.harness.RuntimeLM) against lm-eval's own `hf` backend.

The same model twice: a GPT trained for 2 steps by the launcher (`nxdt-launch cluster_type=local
stages=[data_preparation,training,conversion]`, the demo corpus and tokenizer), loaded by us from its checkpoint and
by lm-eval's HFLM from the conversion stage's Hugging Face export. Throughput needs no trained model, only one big
enough that the forward passes, not Python, take the time (default hidden 768, 6 layers, sequence 512: 46M
parameters). Four local lm-eval tasks are written from Python's standard library sources, seeded:

    lmb_mc         multiple_choice: 3 lines of code, which of 4 lines comes next (multi-token choices)
    lmb_mc_letter  multiple_choice, MMLU-style: the same question with the lines listed, answered " A".." D"
    lmb_gen        generate_until: 3 lines of code, the next line (until "\\n", max_gen_toks 32)
    lmb_rolling    loglikelihood_rolling: ~2000 characters of source (two 512-token windows each)

Each task runs through lm_eval.simple_evaluate, one backend after the other, alternating which goes first, over
--rounds rounds; a first round with log_samples checks that the two agree (metrics and per-request results) and is
not timed. The time is that of the backend's request method (loglikelihood, generate_until, loglikelihood_rolling:
tokenization included, task building not), and requests are counted as lm-eval counts them: one per choice, one per
document otherwise. Both run in this process with the same torch thread count and batch size.

    python benchmarks/lm_eval_backend.py --out lm_eval_backend.json
    python benchmarks/lm_eval_backend.py --hidden 256 --layers 2 --heads 4 --rounds 1     # a quick look
    python benchmarks/lm_eval_backend.py --tasks lmb_mc_letter --hf-logits-cache off      # hf without its cache
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

TASKS = ["lmb_mc", "lmb_mc_letter", "lmb_gen", "lmb_rolling"]
METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


# ---------------------------------------------------------------------------------------------------------------
# The model: trained and exported by the launcher

def build_model(work: Path, args) -> tuple[Path, Path]:
    """-> (checkpoint directory, Hugging Face export) of a run the launcher trains and exports under `work`. The
    launcher resumes: a second run with the same --workdir and shape finds both done and does nothing."""
    run = f"lmb_h{args.hidden}_l{args.layers}_s{args.seq}"
    overrides = [
        "cluster_type=local", "stages=[data_preparation,training,conversion]",
        f"base_results_dir={work / 'results'}", f"data_dir={work / 'data'}",
        "data_preparation.run.node_array_size=1", "data_preparation.workers_per_node=1",
        f"training.run.name={run}", "training.trainer.devices=1", "training.trainer.max_steps=2",
        "training.trainer.val_check_interval=0", "training.trainer.preflight=false",
        "training.trainer.log_every_n_steps=1", "training.exp_manager.create_tensorboard_logger=false",
        "training.exp_manager.create_metrics_plot=false",
        "training.exp_manager.checkpoint_callback_params.every_n_train_steps=2",
        f"training.model.hidden_size={args.hidden}", f"training.model.num_layers={args.layers}",
        f"training.model.num_attention_heads={args.heads}", f"training.model.encoder_seq_length={args.seq}",
        "training.model.micro_batch_size=1", "training.model.global_batch_size=1",
        "training.model.optim.sched.warmup_steps=1",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    log = work / "launch.log"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "launcher.cli", *overrides], cwd=REPO, env=env,
                            capture_output=True, text=True)
    log.write_text(" ".join(overrides) + "\n" + result.stdout + result.stderr)
    if result.returncode != 0:
        sys.exit(f"nxdt-launch failed ({result.returncode}); {log}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    print(f"# model: launcher data_preparation + training (2 steps) + conversion in "
          f"{time.monotonic() - started:.0f} s ({log})", flush=True)
    results = work / "results" / run
    return results / "training" / "checkpoints", results / "conversion" / "hf_model"


# ---------------------------------------------------------------------------------------------------------------
# The tasks: lm-eval YAML + JSON lines, from the standard library's sources

def source_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def code_questions(count: int, seed: int) -> list[dict]:
    """{context, indent, answer, distractors}: three non-blank lines of a file, the non-blank line after them, and
    three other lines from anywhere. Lines of 16-72 characters that are not comments, so choices are alike."""
    rng = random.Random(seed)
    files = [[line for line in f.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
             for f in source_files()]
    fits = lambda line: 16 <= len(line.strip()) <= 72 and not line.strip().startswith("#")  # noqa: E731
    pool = sorted({line.strip() for lines in files for line in lines if fits(line)})
    out = []
    while len(out) < count:
        lines = rng.choice(files)
        if len(lines) < 8:
            continue
        at = rng.randrange(3, len(lines))
        if not fits(lines[at]):
            continue
        answer = lines[at].strip()
        distractors = []
        while len(distractors) < 3:
            line = rng.choice(pool)
            if line != answer and line not in distractors:
                distractors.append(line)
        indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
        out.append({"context": "\n".join(lines[at - 3:at]), "indent": indent, "answer": answer,
                    "distractors": distractors})
    return out


def rolling_texts(count: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    files = [f.read_text(encoding="utf-8", errors="replace") for f in source_files()]
    files = [text for text in files if len(text) > 2 * chars]
    out = []
    for _ in range(count):
        text = rng.choice(files)
        start = text.find("\n", rng.randrange(len(text) - chars)) + 1  # from a line's start
        out.append(text[start:start + chars])
    return out


def write_tasks(directory: Path, args) -> None:
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    mc, letter = [], []
    for q in code_questions(args.mc_docs, seed=2):
        choices = [q["answer"], *q["distractors"]]
        rng.shuffle(choices)
        answer = choices.index(q["answer"])
        mc.append({"question": f"{q['context']}\n{q['indent']}", "choices": choices, "answer": answer})
        listed = "\n".join(f"{'ABCD'[i]}. {c}" for i, c in enumerate(choices))
        letter.append({"question": f"Which line comes next?\n{q['context']}\n{listed}\nAnswer:", "answer": answer})
    gen = [{"question": f"{q['context']}\n{q['indent']}", "answer": q["answer"]}
           for q in code_questions(args.gen_docs, seed=3)]
    rolling = [{"text": text} for text in rolling_texts(args.rolling_docs, args.rolling_chars, seed=4)]

    common = {"dataset_path": "json", "test_split": "test"}
    specs = {
        "lmb_mc": (mc, {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                        "doc_to_target": "answer", "target_delimiter": "",
                        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}),
        "lmb_mc_letter": (letter, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                                   "doc_to_choice": ["A", "B", "C", "D"], "doc_to_target": "answer",
                                   "metric_list": [{"metric": "acc"}]}),
        "lmb_gen": (gen, {"output_type": "generate_until", "doc_to_text": "{{question}}",
                          "doc_to_target": "{{answer}}", "generation_kwargs": {
                              "until": ["\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False},
                          "metric_list": [{"metric": "exact_match"}]}),
        "lmb_rolling": (rolling, {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                                  "doc_to_target": "{{text}}",
                                  "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]}),
    }
    for name, (docs, spec) in specs.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
        task = {"task": name, **common, "dataset_kwargs": {"data_files": {"test": str(data)}}, **spec}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# Timing the request methods

class Timed:
    """Wraps a backend's request methods on the instance (lm-eval calls them by name) and keeps, per call, the
    method, the requests it got and the seconds it took."""

    def __init__(self, lm, batch_size: int):
        self.lm, self.batch_size, self.calls = lm, batch_size, []
        for method in METHODS:
            setattr(lm, method, self._wrap(method, getattr(lm, method)))

    def _wrap(self, method, inner):
        def timed(requests, disable_tqdm: bool = False):
            start = time.perf_counter()
            out = inner(requests, disable_tqdm=True)  # tqdm's own env switch loses to an explicit disable=False
            self.calls.append((method, len(requests), time.perf_counter() - start))
            return out
        return timed

    def run(self, task: str, task_manager, *, log_samples: bool) -> tuple[dict, int, float]:
        """simple_evaluate of one task -> (its results, requests, seconds in the request methods)."""
        import lm_eval

        self.calls = []
        results = lm_eval.simple_evaluate(model=self.lm, tasks=[task], task_manager=task_manager,
                                          batch_size=self.batch_size, bootstrap_iters=0, log_samples=log_samples)
        return results, sum(c[1] for c in self.calls), sum(c[2] for c in self.calls)


# ---------------------------------------------------------------------------------------------------------------
# Agreement

def compare(task: str, ours: dict, hf: dict) -> dict:
    """Metrics side by side, and the largest per-request difference: |log-likelihood| for the scoring tasks,
    generations that differ for generate_until."""
    metrics = {}
    agree = True
    for key, value in hf["results"][task].items():
        if key in ("alias", "sample_len") or "stderr" in key or not isinstance(value, (int, float)):
            continue
        mine = ours["results"][task][key]
        close = bool(abs(mine - value) <= 1e-4 * max(1.0, abs(value)))
        agree &= close
        metrics[key] = {"ours": float(mine), "hf": float(value), "agree": close}
    worst, greedy_differs, text_differs, generated = 0.0, 0, 0, []
    for a, b in zip(ours["samples"][task], hf["samples"][task], strict=True):
        for x, y in zip(a["resps"], b["resps"], strict=True):
            x, y = x[0], y[0]
            if isinstance(x, (tuple, list)):
                worst = max(worst, abs(x[0] - y[0]))
                greedy_differs += bool(x[1]) != bool(y[1])
            elif isinstance(x, float):
                worst = max(worst, abs(x - y))
            else:
                text_differs += x != y
                generated.append(len(y))
    return {"metrics": metrics, "max_loglikelihood_diff": worst, "is_greedy_differs": greedy_differs,
            "generations_differ": text_differs, "generated_chars_mean": statistics.fmean(generated or [0]),
            "agree": agree}


# ---------------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="where the data, model, export and tasks are built (default: a temp dir, "
                                          "removed at the end)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512, help="the model's sequence length and both max_length")
    parser.add_argument("--batch", type=int, default=8, help="both backends' batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both backends)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the untimed agreement round")
    parser.add_argument("--mc-docs", type=int, default=24)
    parser.add_argument("--gen-docs", type=int, default=16)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--rolling-docs", type=int, default=6)
    parser.add_argument("--rolling-chars", type=int, default=2000)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS, help="the tasks to time (default: all)")
    parser.add_argument("--hf-logits-cache", choices=("on", "off"), default="on",
                        help="HFLM's logits_cache (lm-eval's default on: one forward for all the one-token "
                             "continuations of a context)")
    args = parser.parse_args()

    temp = None if args.workdir else tempfile.mkdtemp(prefix="lm_eval_backend_")
    work = Path(args.workdir or temp).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # Offline, and lm-eval's datasets cache inside the work directory (not the user's).
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf_datasets"),
                      TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")  # no progress bars: 32 runs of them
    try:
        report = measure(work, args)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if not all(c["agree"] for c in report["agreement"].values()):
        sys.exit("the two backends' metrics differ (see above): the speeds compare different work")


def measure(work: Path, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"# torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}, max_length {args.seq}; "
          f"load average at the start: {load_start[0]:.2f} on {os.cpu_count()} CPUs; work dir {work}", flush=True)
    checkpoints, hf_dir = build_model(work, args)
    write_tasks(work / "tasks", args)

    for name in ("lm_eval", "lm-eval", "transformers", "datasets"):  # lm-eval's info lines, 2 x 4 x 4 runs of them
        logging.getLogger(name).setLevel(logging.ERROR)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from runtime.device import init_device
    from runtime.evaluate import harness
    from runtime.evaluate.model import load_model

    device = init_device("cpu")
    loaded = load_model(str(checkpoints), None, tp=1, pp=1, vpp=None, device=device)
    ours = harness.RuntimeLM(loaded, device, tokenizer_path=loaded.training["model"]["tokenizer"]["model"],
                             batch_size=args.batch, max_length=args.seq)
    # What simple_evaluate(model="hf", model_args={...}, batch_size=B) builds, built once here.
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", max_length=args.seq, device="cpu", batch_size=args.batch,
              logits_cache=args.hf_logits_cache == "on")
    params = sum(p.numel() for p in hf.model.parameters())
    print(f"# model: GPT, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, sequence {args.seq}, "
          f"{params / 1e6:.1f}M parameters (vocabulary {hf.model.config.vocab_size}); hf logits_cache "
          f"{args.hf_logits_cache}", flush=True)
    backends = {"ours": Timed(ours, args.batch), "hf": Timed(hf, args.batch)}
    task_manager = TaskManager(include_path=str(work / "tasks"), include_defaults=False)

    agreement, kinds = agreement_round(backends, args.tasks, task_manager)
    samples = timed_rounds(backends, args.tasks, task_manager, args.rounds)
    load_end = os.getloadavg()
    print(f"# load average at the end: {load_end[0]:.2f} (5 min {load_end[1]:.2f}) on {os.cpu_count()} CPUs\n")
    return {"model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
                      "params": params},
            "hf_logits_cache": args.hf_logits_cache, "batch": args.batch, "threads": args.threads,
            "rounds": args.rounds, "load_average_start": load_start, "load_average_end": load_end,
            "cpus": os.cpu_count(), "torch": torch.__version__, "agreement": agreement,
            "tasks": table(samples, kinds)}


def agreement_round(backends: dict, tasks: list[str], task_manager) -> tuple[dict, dict]:
    """Round 0, untimed: each task on both, with their samples, compared; also each side's warm-up.
    -> (agreement per task, output type per task)."""
    agreement, kinds = {}, {}
    for task in tasks:
        results = {side: b.run(task, task_manager, log_samples=True)[0] for side, b in backends.items()}
        a = agreement[task] = compare(task, results["ours"], results["hf"])
        kinds[task] = results["hf"]["configs"][task]["output_type"]
        line = ", ".join(f"{k} ours {v['ours']:.6g} hf {v['hf']:.6g}" for k, v in a["metrics"].items())
        line += f"; max |loglik diff| {a['max_loglikelihood_diff']:.2e}, is_greedy differs {a['is_greedy_differs']}"
        if kinds[task] == "generate_until":
            line += (f", generations differ {a['generations_differ']} (hf's: {a['generated_chars_mean']:.0f} "
                     f"characters on average)")
        print(f"# {task}: {line}" + ("" if a["agree"] else "  <-- METRICS DIFFER"), flush=True)
    return agreement, kinds


def timed_rounds(backends: dict, tasks: list[str], task_manager, rounds: int) -> dict:
    """-> {task: {side: [(requests, seconds) per round]}}. Per task the two run back to back, which goes first
    alternating, so load from elsewhere on the machine falls on both."""
    samples = {task: {side: [] for side in backends} for task in tasks}
    for round_index in range(rounds):
        for number, task in enumerate(tasks):
            for side in ("ours", "hf") if (round_index + number) % 2 == 0 else ("hf", "ours"):
                _, requests, seconds = backends[side].run(task, task_manager, log_samples=False)
                samples[task][side].append((requests, seconds))
        print(f"# round {round_index + 1}/{rounds} done", flush=True)
    return samples


def table(samples: dict, kinds: dict) -> dict:
    """Prints the markdown table: per task and overall (all requests over all the time of a round), the median
    over rounds of each side's requests/s, their ratio, and the median of the per-round ratios ("paired")."""
    rounds = len(next(iter(samples.values()))["ours"])
    samples = {**samples, "overall": {side: [(sum(samples[t][side][r][0] for t in samples),
                                              sum(samples[t][side][r][1] for t in samples)) for r in range(rounds)]
                                      for side in ("ours", "hf")}}
    rows = {}
    print("| task | output type | requests | ours req/s | hf req/s | ours / hf | ours / hf, paired |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for task, per in samples.items():
        rate = {side: statistics.median(n / s for n, s in per[side]) for side in per}
        paired = statistics.median((n1 / s1) / (n2 / s2) for (n1, s1), (n2, s2) in zip(per["ours"], per["hf"]))
        kind, requests = kinds.get(task, "all"), per["ours"][0][0]
        rows[task] = {"output_type": kind, "requests": requests, "ours_req_s": rate["ours"], "hf_req_s": rate["hf"],
                      "ratio": rate["ours"] / rate["hf"], "paired_ratio": paired,
                      "ours_s": [s for _, s in per["ours"]], "hf_s": [s for _, s in per["hf"]]}
        print(f"| {task} | {kind} | {requests} | {rate['ours']:.1f} | {rate['hf']:.1f} | "
              f"{rate['ours'] / rate['hf']:.2f} | {paired:.2f} |")
    return rows


if __name__ == "__main__":
    main()
