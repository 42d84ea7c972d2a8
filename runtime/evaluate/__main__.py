"""The evaluation stage: `python -m runtime.evaluate --config <evaluation_config.yaml>`, one process per device
(torchrun), like training.

Loads the newest complete checkpoint of a training run (or a named one) under the evaluation's own tp x pp
(x virtual pp) layout, whatever layout trained it, and runs the configured tasks:

    validation_loss, test_loss     mean loss and perplexity on those splits of the training data
    {type: loss, data_prefix: ...} the same on any indexed dataset
    hellaswag, arc_easy, ...       lm-evaluation-harness tasks, groups and tags (with evaluation.include_path, your
                                   own task YAML files), scored by lm-eval over our model (runtime/evaluate/harness.py)
    {type: last_word | multiple_choice | perplexity, path: ...}   local JSON-lines files, scored by lm-eval through
                                   the task files in runtime/evaluate/task_files
    {type: synthetic_demo, corpus: <dir of demo .jsonl>}   the built-in task the demo model learns (the same way)
    {type: exact_match, path: <chat .jsonl>, baseline: true}   generated answers against references, before
                                   (the run's starting weights) and after (runtime/evaluate/exact_match.py)

Results go to <run.results_dir>/results.json (lm-eval's own results beside it, lm_eval_results.json) and a table
on stdout. Mistakes end with one `error: ...` line and exit code 2, before the model loads.
"""
from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import yaml

from runtime.checkpoint import resolve_checkpoint
from runtime.config import TrainingConfig, parse_training_config
from runtime.data import DataParallelBatches, build_split_dataset
from runtime.data.loader import end_of_document
from runtime.device import init_device, shutdown
from runtime.evaluate.exact_match import evaluate_exact_match, load_exact_match
from runtime.evaluate import lm_tasks
from runtime.evaluate.model import LoadedModel, load_baseline, load_model
from runtime.evaluate.report import print_table, print_user_error, write_results
from runtime.evaluate.synthetic import build_demo_task
from runtime.evaluate.tasks import load_task, write_normalized
from runtime.io.files import atomic_write_bytes
from runtime.metrics import format_duration
from runtime.schema.evaluation import EvaluationConfig, TaskSpec, parse_evaluation
from runtime.schema.facts import USER_ERROR_EXIT_CODE
from runtime.schema.reader import ConfigErrors
from runtime.step import eval_step

LOCAL_TYPES = tuple(lm_tasks.LOCAL_TYPES)  # scored by lm-eval through this repository's task files


def _loss_task(loaded: LoadedModel, training: TrainingConfig, device, name: str, split: str, data_prefix,
               limit_batches: int, index_dir: str | None) -> dict:
    data = training.data
    dp = loaded.topo.dp
    dataset = build_split_dataset(
        split=split, num_samples=limit_batches * data.global_batch_size, data_prefix=data_prefix,
        splits_string=data.splits_string if split != "all" else "100,0,0", seq_length=data.seq_length,
        seed=training.seed, index_mapping_dir=index_dir or data.index_mapping_dir,
        is_builder=device.local_rank == 0, barrier=device.barrier)
    # Documents separated as in training (model.data.reset_*): the loss it trained on.
    batches = DataParallelBatches(dataset, global_batch_size=data.global_batch_size,
                                  micro_batch_size=data.micro_batch_size, dp_rank=dp.rank, dp_size=dp.size,
                                  end_of_document=end_of_document(data, training.tokenizer_path))
    micro = []
    for index in range(limit_batches):
        for batch in batches.batch_at(index * data.global_batch_size):
            micro.append(batch._replace(input_ids=batch.input_ids.to(device.torch_device),
                                        labels=batch.labels.to(device.torch_device)))
    loss = eval_step(loaded.model, micro, loaded.topo)
    device.step_boundary()
    tokens = limit_batches * data.global_batch_size * data.seq_length
    return {"task": name, "type": "loss", "num_examples": tokens, "loss": loss, "ppl": math.exp(min(loss, 700))}


class Progress:
    """"demo_code_lines (3/3): 120/400 requests, 0:00:21 left", on rank 0 at most every `every_s` seconds, so a
    long task is never silent and a log stays short."""

    def __init__(self, label: str, *, enabled: bool, every_s: float = 10.0):
        self.label, self.enabled, self.every_s = label, enabled, every_s
        self.started = self.last = time.monotonic()
        if enabled:
            print(f"{label}: started", flush=True)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < self.every_s or done >= total:
            return
        self.last = now
        left = (now - self.started) / max(done, 1) * (total - done)
        print(f"{self.label}: {done}/{total} requests, {format_duration(left)} left", flush=True)


def _exact_match_task(spec, loaded: LoadedModel, device, tokenizer_path: str, batch_size: int, max_length: int,
                      results_dir: Path, baseline, progress: Progress) -> dict:
    """Scores one exact_match task; its completions (and the baseline's) go to tasks/<name>.completions.jsonl."""
    task = load_exact_match(spec.name, spec.options)
    run_template = ((loaded.training.get("model") or {}).get("data") or {}).get("chat_template")
    result, rows = evaluate_exact_match(task, loaded.model, tokenizer_path=tokenizer_path, chat_template=run_template,
                                        batch_size=batch_size, max_length=max_length,
                                        baseline=baseline() if baseline else None, progress=progress)
    if device.is_main:
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        atomic_write_bytes(results_dir / "tasks" / f"{spec.name}.completions.jsonl", lines.encode())
    return result


def run_tasks(cfg: EvaluationConfig, loaded: LoadedModel, device, results_dir: Path, task_manager=None
              ) -> list[dict]:
    """Every task of the config, in its order; the lm-eval ones (names and local types) in one lm-eval run, their
    rows where the first of them stands."""
    tokenizer_path = cfg.tokenizer_model or loaded.training["model"]["tokenizer"]["model"]
    max_length = cfg.max_length or loaded.cfg.max_position_embeddings
    batch_size, limit_batches = cfg.micro_batch_size, cfg.limit_batches
    # The data the checkpoint was trained on, for the loss tasks (a checkpoint imported from Hugging Face has
    # no training config beyond its model, and can still run the zero-shot tasks).
    needs_data = any(spec.type == "loss" for spec in cfg.tasks)
    training = parse_training_config(loaded.training) if needs_data else None

    @functools.cache
    def starting_weights():  # built once, when the first task with baseline: true asks
        model, where = load_baseline(loaded, device)
        if device.is_main:
            print(f"baseline: {where}", flush=True)
        return model, where

    results: list[dict | None] = []
    harness_tasks: list[str | dict] = []
    for number, spec in enumerate(cfg.tasks, start=1):
        started = time.perf_counter()
        options = spec.options
        if spec.type == "lm_eval" or spec.type in LOCAL_TYPES:
            harness_tasks.append(spec.name if spec.type == "lm_eval" else
                                 _local_task(spec, results_dir, device))
            if len(harness_tasks) == 1:
                results.append(None)  # where lm-eval's rows go
            continue
        report = Progress(f"{spec.name} ({number}/{len(cfg.tasks)})", enabled=device.is_main)
        if spec.type == "loss":
            result = _loss_task(loaded, training, device, spec.name, options.get("split", "all"),
                                options.get("data_prefix") or training.data.data_prefix,
                                int(options.get("limit_batches") or limit_batches), options.get("index_mapping_dir"))
        else:
            result = _exact_match_task(spec, loaded, device, str(tokenizer_path), batch_size, max_length,
                                       results_dir, starting_weights if spec.options["baseline"] else None, report)
        if device.is_main:
            print(f"{result['task']}: done in {time.perf_counter() - started:.1f} s", flush=True)
        results.append(result)
    if harness_tasks:
        rows = _harness(cfg, loaded, device, harness_tasks, str(tokenizer_path), max_length, results_dir,
                        task_manager)
        at = results.index(None)
        results[at:at + 1] = rows
    return results  # type: ignore[return-value]  # the placeholder was replaced


def _local_task(spec: TaskSpec, results_dir: Path, device) -> dict:
    """A local file (checked before the model loaded), normalized for its lm-eval task file by the main rank."""
    options = spec.options
    path = results_dir / "tasks" / f"{spec.name}.jsonl"
    normalized = results_dir / "tasks" / f"{spec.name}.lm_eval.jsonl"
    if device.is_main:
        if spec.type == "synthetic_demo":
            corpus = sorted(glob.glob(os.path.join(str(options.get("corpus", "")), "*.jsonl")))
            path.parent.mkdir(parents=True, exist_ok=True)
            build_demo_task(corpus, str(path), num_examples=int(options.get("num_examples", 200)),
                            seed=int(options.get("seed", 0)))
            task = load_task({"name": spec.name, "type": "multiple_choice", "path": str(path)})
        else:
            task = load_task({**options, "name": spec.name, "type": spec.type})
        write_normalized(task, normalized)
    device.barrier()
    return lm_tasks.local_task(spec.name, spec.type, normalized)


def _harness(cfg: EvaluationConfig, loaded: LoadedModel, device, tasks: list[str | dict], tokenizer_path: str,
             max_length: int, results_dir: Path, task_manager) -> list[dict]:
    from runtime.evaluate import harness

    progress: dict[str, Progress] = {}

    def report(what: str, done: int, total: int) -> None:
        if what not in progress:
            progress[what] = Progress(f"lm-eval {what}", enabled=device.is_main)
        progress[what](done, total)

    started = time.perf_counter()
    options = cfg.lm_eval
    lm = harness.RuntimeLM(loaded, device, tokenizer_path=tokenizer_path, batch_size=cfg.micro_batch_size,
                           max_length=max_length, progress=report)
    if task_manager is None:
        task_manager = lm_tasks.task_manager(options.include_path, defaults=False)
    output = harness.run(lm, tasks, task_manager=task_manager, num_fewshot=options.num_fewshot, limit=options.limit,
                         apply_chat_template=options.apply_chat_template,
                         fewshot_as_multiturn=options.fewshot_as_multiturn, bootstrap_iters=options.bootstrap_iters)
    if device.is_main:
        atomic_write_bytes(results_dir / "lm_eval_results.json", harness.results_json(output).encode())
        print(f"lm-eval ({len(tasks)} task{'s' if len(tasks) > 1 else ''}): done in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
    return harness.result_rows(output)


def check_inputs(cfg: EvaluationConfig):
    """Every input a task reads, before the model loads: local task files, lm-eval task names and their data
    (read offline). Returns the lm-eval TaskManager that knows the names (None without lm-eval tasks)."""
    for spec in cfg.tasks:
        if spec.type == "exact_match":
            load_exact_match(spec.name, spec.options)
        elif spec.type == "synthetic_demo":
            if not glob.glob(os.path.join(str(spec.options.get("corpus", "")), "*.jsonl")):
                raise ValueError(f"tasks[{spec.name}].corpus: no .jsonl files in {spec.options.get('corpus')!r}; "
                                 f"run the demo data_preparation stage first")
        elif spec.type in LOCAL_TYPES:
            load_task({**spec.options, "name": spec.name, "type": spec.type})
    names = [spec.name for spec in cfg.tasks if spec.type == "lm_eval"]
    if not names and not any(spec.type in LOCAL_TYPES for spec in cfg.tasks):
        return None
    lm_tasks.offline(cfg.lm_eval.datasets_cache)
    manager, errors, missing = lm_tasks.resolve(names, cfg.lm_eval.include_path, cfg.lm_eval.datasets_cache)
    errors += missing
    for name in names if not errors else ():
        try:
            manager.load([name])  # reads the data now (offline): what is missing fails here
        except (OSError, ValueError) as error:
            errors.append(lm_tasks.dataset_missing(name, _dataset_of(manager, name, error), error,
                                                   datasets_cache=cfg.lm_eval.datasets_cache))
    if errors:
        raise ConfigErrors(errors)
    return manager


def _dataset_of(manager, name: str, error: BaseException) -> str | None:
    import re

    found = re.search(r"Couldn't reach '([^']+)'", str(error))
    if found:
        return found.group(1)
    entry = manager.task_index.get(name)
    return (entry.cfg or {}).get("dataset_path") if entry is not None else None


def settings_digest(raw: dict) -> str:
    """What the scores depend on: the evaluation config without its run section (job name, time limit, paths of
    logs), which running it again may change freely."""
    relevant = {key: value for key, value in raw.items() if key != "run"}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def earlier_results(cfg: EvaluationConfig, settings: str) -> dict | None:
    """results.json of an earlier run of this stage that scored the same checkpoint with the same config, or None.
    A re-run of the pipeline then repeats nothing; a newer checkpoint or any changed setting scores again."""
    try:
        earlier = json.loads((Path(cfg.results_dir) / "results.json").read_text())
        storage, checkpoint = resolve_checkpoint(cfg.checkpoint_dir, cfg.checkpoint_name)
    except (OSError, ValueError):  # none yet, or no checkpoint (load_model then says why)
        return None
    same = (isinstance(earlier, dict) and earlier.get("settings") == settings
            and earlier.get("checkpoint") == f"{storage.root}/{checkpoint.name}"
            and isinstance(earlier.get("tasks"), list))
    return earlier if same else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved evaluation-stage YAML the launcher wrote")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0") or 0)
    device = None
    try:
        raw = yaml.safe_load(Path(args.config).read_text())
        cfg, report = parse_evaluation(raw)
        report.raise_if_any()
        task_manager = check_inputs(cfg)  # a missing file, task or dataset fails now, not after the model loads
        settings = settings_digest(raw)
        done = earlier_results(cfg, settings)
        if done is not None:  # every rank reads the same file and leaves the same way
            if rank == 0:
                print(f"evaluation: {cfg.results_dir}/results.json already scores {done['checkpoint']} (step "
                      f"{done['step']}) with this config; nothing to do", flush=True)
                print_table(done["tasks"])
            return 0
        device = init_device(cfg.accelerator)
        loaded = load_model(cfg.checkpoint_dir, cfg.checkpoint_name, tp=cfg.tp, pp=cfg.pp, vpp=cfg.virtual_pp,
                            device=device, tokenizer_path=cfg.tokenizer_model)
        results_dir = Path(cfg.results_dir)
        if device.is_main:
            print(f"evaluating {loaded.location} (step {loaded.step}, trained at {loaded.saved_layout}) at "
                  f"{loaded.topo!r}", flush=True)
        results = run_tasks(cfg, loaded, device, results_dir, task_manager)
        if device.is_main:
            write_results(results, results_dir / "results.json", checkpoint=loaded.location, step=loaded.step,
                          settings=settings)
            print_table(results)
            print(f"results: {results_dir / 'results.json'}")
        device.barrier()  # leave together (rank 0 was writing): see runtime/train.py main
    except (ValueError, FileNotFoundError, KeyError) as error:
        if rank == 0:
            print_user_error(error)
        return USER_ERROR_EXIT_CODE
    finally:
        if device is not None:
            shutdown(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
