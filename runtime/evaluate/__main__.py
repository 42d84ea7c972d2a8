"""The evaluation stage: `python -m runtime.evaluate --config <evaluation_config.yaml>`, one process per device
(torchrun), like training.

Loads the newest complete checkpoint of a training run (or a named one) under the evaluation's own tp x pp
(x virtual pp) layout, whatever layout trained it, and runs the configured tasks:

    validation_loss, test_loss     mean loss and perplexity on those splits of the training data
    {type: loss, data_prefix: ...} the same on any indexed dataset
    {type: last_word | multiple_choice, path: ...}   zero-shot tasks from local lm-eval-style files
    {type: synthetic_demo, corpus: <dir of demo .jsonl>}   the built-in task the demo model learns

Results go to <run.results_dir>/results.json and a table on stdout. Mistakes end with one `error: ...` line
and exit code 2.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time
from pathlib import Path

import yaml

from runtime.config import TrainingConfig, parse_training_config
from runtime.data import DataParallelBatches, build_split_dataset
from runtime.device import init_device, shutdown
from runtime.evaluate.model import LoadedModel, forward_logprobs_fn, load_model
from runtime.evaluate.report import print_table, write_results
from runtime.evaluate.synthetic import build_demo_task
from runtime.evaluate.tasks import evaluate_task, load_task
from runtime.step import eval_step

SPLITS = {"validation_loss": "valid", "test_loss": "test"}


def _loss_task(loaded: LoadedModel, training: TrainingConfig, device, name: str, split: str, data_prefix,
               limit_batches: int, index_dir: str | None) -> dict:
    data = training.data
    dp = loaded.topo.dp
    dataset = build_split_dataset(
        split=split, num_samples=limit_batches * data.global_batch_size, data_prefix=data_prefix,
        splits_string=data.splits_string if split != "all" else "100,0,0", seq_length=data.seq_length,
        seed=training.seed, index_mapping_dir=index_dir or data.index_mapping_dir,
        is_builder=device.local_rank == 0, barrier=device.barrier)
    batches = DataParallelBatches(dataset, global_batch_size=data.global_batch_size,
                                  micro_batch_size=data.micro_batch_size, dp_rank=dp.rank, dp_size=dp.size)
    micro = []
    for index in range(limit_batches):
        for ids, labels, mask in batches.batch_at(index * data.global_batch_size):
            micro.append((ids.to(device.torch_device), labels.to(device.torch_device), mask))
    loss = eval_step(loaded.model, micro, loaded.topo)
    device.step_boundary()
    tokens = limit_batches * data.global_batch_size * data.seq_length
    return {"task": name, "type": "loss", "num_examples": tokens, "loss": loss, "ppl": math.exp(min(loss, 700))}


def _tokenizer(path: str):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def run_tasks(cfg: dict, loaded: LoadedModel, device, results_dir: Path) -> list[dict]:
    tokenizer_path = cfg.get("tokenizer_model") or loaded.training["model"]["tokenizer"]["model"]
    tokenize = _tokenizer(str(tokenizer_path))
    forward = forward_logprobs_fn(loaded, device)
    max_length = int(cfg.get("max_length") or loaded.cfg.max_position_embeddings)
    batch_size = int(cfg.get("micro_batch_size") or 4)
    limit_batches = int(cfg.get("limit_batches") or 8)
    # The data the checkpoint was trained on, for the loss tasks (a checkpoint imported from Hugging Face has
    # no training config beyond its model, and can still run the zero-shot tasks).
    specs = cfg.get("tasks") or []
    needs_data = any(isinstance(s, str) or (isinstance(s, dict) and s.get("type") == "loss") for s in specs)
    training = parse_training_config(loaded.training) if needs_data else None
    results = []
    for spec in specs:
        started = time.perf_counter()
        if isinstance(spec, str):
            if spec not in SPLITS:
                raise ValueError(f"tasks: {spec!r} is not a built-in task; built-in: {', '.join(SPLITS)}, or give "
                                 f"a mapping with type last_word | multiple_choice | synthetic_demo | loss")
            result = _loss_task(loaded, training, device, spec, SPLITS[spec], training.data.data_prefix,
                                limit_batches, None)
        elif isinstance(spec, dict) and spec.get("type") == "loss":
            result = _loss_task(loaded, training, device, str(spec.get("name", "loss")), spec.get("split", "all"),
                                spec["data_prefix"], int(spec.get("limit_batches") or limit_batches),
                                spec.get("index_mapping_dir"))
        elif isinstance(spec, dict) and spec.get("type") == "synthetic_demo":
            corpus = sorted(glob.glob(os.path.join(str(spec.get("corpus", "")), "*.jsonl")))
            if not corpus:
                raise ValueError(f"tasks[{spec.get('name', 'synthetic_demo')}].corpus: no .jsonl files in "
                                 f"{spec.get('corpus')!r}; run the demo data_preparation stage first")
            path = results_dir / "tasks" / f"{spec.get('name', 'demo_code_lines')}.jsonl"
            if device.is_main:
                path.parent.mkdir(parents=True, exist_ok=True)
                build_demo_task(corpus, str(path), num_examples=int(spec.get("num_examples", 200)),
                                seed=int(spec.get("seed", 0)))
            device.barrier()
            task = load_task({"name": spec.get("name", "demo_code_lines"), "type": "multiple_choice",
                              "path": str(path)})
            result = evaluate_task(task, tokenize, forward, max_length=max_length, batch_size=batch_size)
        elif isinstance(spec, dict):
            task = load_task(spec)
            result = evaluate_task(task, tokenize, forward, max_length=max_length, batch_size=batch_size)
        else:
            raise ValueError(f"tasks: {spec!r} is neither a built-in task name nor a mapping")
        if device.is_main:
            print(f"{result['task']}: done in {time.perf_counter() - started:.1f} s", flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved evaluation-stage YAML the launcher wrote")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0") or 0)
    device = None
    try:
        cfg = yaml.safe_load(Path(args.config).read_text())
        layout = cfg.get("model") or {}
        device = init_device((cfg.get("trainer") or {}).get("accelerator", "cpu"))
        loaded = load_model(str(cfg["checkpoint_dir"]), cfg.get("checkpoint_name"), tp=int(layout.get("tensor_model_parallel_size") or 1),
                            pp=int(layout.get("pipeline_model_parallel_size") or 1),
                            vpp=layout.get("virtual_pipeline_model_parallel_size"), device=device,
                            tokenizer_path=cfg.get("tokenizer_model"))
        results_dir = Path(cfg["run"]["results_dir"])
        if device.is_main:
            print(f"evaluating {loaded.location} (step {loaded.step}, trained at {loaded.saved_layout}) at "
                  f"{loaded.topo!r}", flush=True)
        results = run_tasks(cfg, loaded, device, results_dir)
        if device.is_main:
            write_results(results, results_dir / "results.json", checkpoint=loaded.location, step=loaded.step)
            print_table(results)
            print(f"results: {results_dir / 'results.json'}")
    except (ValueError, FileNotFoundError, KeyError) as error:
        if rank == 0:
            message = f"{error!s}" if not isinstance(error, KeyError) else f"{error.args[0]} is missing"
            print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        return 2
    finally:
        if device is not None:
            shutdown(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
