"""One array task of the data_preparation stage, start to finish.

    shards = every shard of the stage (plan.build_shards), in one fixed order
    mine   = shards[task_index::num_tasks]
    tokenizer ready in output_dir (trained once, see tokenizer.py) -> for each of mine not already done:
    tokenize it with workers_per_node processes -> try to finalize (blend.txt, summary.json)

input.source synthetic_instructions is one task that writes the fine-tuning demo (runtime/sft/synthetic.py);
synthetic_preferences likewise writes the alignment demo's preference pairs (runtime/alignment/synthetic.py),
synthetic_prompts the rl demo's prompts with exact answers (runtime/rl/synthetic.py).
"""
from __future__ import annotations

from pathlib import Path

from runtime.data_prep import plan
from runtime.schema.data_preparation import SYNTHETIC, SYNTHETIC_PREFERENCES, SYNTHETIC_PROMPTS, StageConfig, UserError
from runtime.data_prep.encode import EncoderSpec, init_worker
from runtime.data_prep.finalize import try_finalize
from runtime.io.files import sha256_file
from runtime.data_prep.progress import Reporter
from runtime.data_prep.shard import done_summary, ensure_input, fingerprint, process_shard
from runtime.data_prep.tokenizer import encoder_spec, prepare_tokenizer
from runtime.workers import OrderedPool


def run_task(cfg: StageConfig, task_index: int = 0, num_tasks: int = 1, reporter: Reporter | None = None) -> bool:
    """Processes this task's shards; returns True when this task also finalized the stage."""
    if not 0 <= task_index < num_tasks:
        raise UserError(f"--task-index {task_index} with --num-tasks {num_tasks}: the index must be in "
                        f"0..{num_tasks - 1}")
    reporter = reporter or Reporter(f"data_prep task {task_index}/{num_tasks}", cfg.log_interval_s)
    try:
        return _run(cfg, task_index, num_tasks, reporter)
    finally:
        reporter.close()


def _tokenizer_files_exist(cfg: StageConfig) -> bool:
    names = ["tokenizer.json"] + (["tokenizer.model"] if cfg.tokenizer.library == "sentencepiece" else [])
    return all((Path(cfg.output_dir) / n).exists() for n in names)


def _run(cfg: StageConfig, task_index: int, num_tasks: int, reporter: Reporter) -> bool:
    if cfg.input.source in _SYNTHETIC_WRITERS:
        return _synthetic(cfg, task_index, reporter)
    shards = plan.build_shards(cfg)
    mine = plan.shards_for_task(shards, task_index, num_tasks)
    reporter.log(f"{len(mine)} of {len(shards)} shards: {', '.join(s.name for s in mine[:8])}"
                 f"{' ...' if len(mine) > 8 else ''} -> {cfg.output_dir}")
    if mine:
        spec = prepare_tokenizer(cfg, shards, reporter.log)
    elif _tokenizer_files_exist(cfg):
        spec = encoder_spec(cfg)        # nothing to tokenize here, but this task may still finalize
    else:
        reporter.log("no shards for this task and no tokenizer yet; the other tasks will finalize")
        return False
    tokenizer_sha = sha256_file(spec.path)
    reporter.log(f"tokenizer {spec.path}: vocab {spec.vocab_size}, eod id {spec.eod_id}, {spec.dtype} ids, "
                 f"encoded by {spec.engine}")

    def expected(shard: plan.Shard) -> dict:
        return fingerprint(cfg, shard, spec, tokenizer_sha)

    todo = []
    for shard in mine:
        if cfg.input.source == "demo":
            ensure_input(cfg, shard, reporter.log)    # its size is part of the fingerprint
        if done_summary(cfg, shard, expected(shard)):
            reporter.log(f"{shard.name}: already complete, skipping")
        else:
            todo.append(shard)
    if todo:
        _tokenize(cfg, todo, spec, expected, reporter)
    return try_finalize(cfg, shards, expected, reporter.log)


# input.source -> the module whose write_demo writes it, and what its records are (runtime/sft/synthetic.py,
# runtime/alignment/synthetic.py, runtime/rl/synthetic.py; their settings sections are named like the source and
# hold write_demo's keyword arguments).
_SYNTHETIC_WRITERS = {SYNTHETIC: ("runtime.sft.synthetic", "records"),
                      SYNTHETIC_PREFERENCES: ("runtime.alignment.synthetic", "pairs"),
                      SYNTHETIC_PROMPTS: ("runtime.rl.synthetic", "prompts")}


def _synthetic(cfg: StageConfig, task_index: int, reporter: Reporter) -> bool:
    """A demo the fine-tuning, alignment or rl recipes read: train/valid/test.jsonl, tokenizer.json and
    tokenizer_config.json, summary.json in output_dir. Task 0 writes it; a second task (none is planned) would
    only race it."""
    import dataclasses
    import importlib

    source = cfg.input.source
    module, noun = _SYNTHETIC_WRITERS[source]
    if task_index != 0:
        reporter.log(f"{source} is written by task 0 alone; nothing to do here")
        return False
    settings = getattr(cfg, source)
    try:
        wrote = importlib.import_module(module).write_demo(cfg.output_dir, **dataclasses.asdict(settings))
    except ValueError as error:  # parse_config checks the same bounds; named here should they ever differ
        raise UserError(f"{source}: {error}") from None
    counts = f"{settings.num_train} train, {settings.num_valid} valid, {settings.num_test} test {noun}"
    tokenizer = f"tokenizer of {settings.vocab_size} tokens" if hasattr(settings, "vocab_size") else \
        f"word-level tokenizer of {settings.num_symbols} symbols"
    reporter.log(f"{source}: {'wrote' if wrote else 'already complete, skipping:'} {counts}, {tokenizer}, seed "
                 f"{settings.seed} -> {cfg.output_dir}")
    return True


def _tokenize(cfg: StageConfig, todo: list[plan.Shard], spec: EncoderSpec, expected, reporter: Reporter) -> None:
    # Not ProcessPoolExecutor: it hangs if a worker is killed while sending a result (runtime/workers.py).
    with OrderedPool(cfg.workers_per_node, init_worker, (spec,)) as pool:
        for shard in todo:
            process_shard(cfg, shard, spec, expected(shard), pool, reporter)
