# The evaluation stage's config (runtime/evaluate): which checkpoint, under which layout, on which tasks.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.choices import TASK_TYPES
from runtime.schema.reader import Choices, Report, Section

# Tasks by name: the loss over the training data's validation or test split.
BUILTIN_TASKS = {"validation_loss": "valid", "test_loss": "test"}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    type: str                  # one of TASK_TYPES, or "lm_eval" (a name lm-eval knows: runtime/evaluate/lm_tasks.py)
    options: dict              # the task's own keys (path, data_prefix, corpus, limit, ...), read by runtime/evaluate;
                               # exact_match's already typed here (_exact_match_options)


@dataclass(frozen=True)
class EvaluationConfig:
    results_dir: str
    num_nodes: int
    devices: int
    accelerator: str
    tp: int
    pp: int
    virtual_pp: int | None
    checkpoint_dir: str
    checkpoint_name: str | None
    tokenizer_model: str | None      # default: the tokenizer the checkpoint was trained with
    micro_batch_size: int
    max_length: int | None           # default: the model's max_position_embeddings
    limit_batches: int
    tasks: tuple[TaskSpec, ...]
    lm_eval: "LmEvalOptions"


@dataclass(frozen=True)
class LmEvalOptions:
    """lm-eval's own options, for every task it runs (the lm-eval names and the local types)."""
    include_path: str | None         # a folder of the user's task YAML files (lm-eval's --include_path)
    num_fewshot: int | None          # None: each task's own
    limit: float | None              # examples per task: N >= 1, or a fraction below 1 (lm-eval's --limit)
    apply_chat_template: bool        # render prompts with the tokenizer's chat template
    fewshot_as_multiturn: bool       # with the template: few-shot examples as turns
    bootstrap_iters: int             # lm-eval's stderr resamples for non-mean metrics (0: none)
    datasets_cache: str | None       # where Hugging Face datasets are read from (HF_DATASETS_CACHE); never downloaded


def parse_evaluation(raw: Any, p: str = "evaluation.") -> tuple[EvaluationConfig | None, Report]:
    report = Report()
    s = Section(raw, p.rstrip("."), report)
    trainer, layout = s.section("trainer"), s.section("model")
    values = dict(
        results_dir=s.section("run").str("results_dir"),
        num_nodes=trainer.int("num_nodes", 1, minimum=1), devices=trainer.int("devices", 1, minimum=1),
        accelerator=trainer.choice("accelerator", C.ACCELERATORS, "cpu"),
        tp=layout.int("tensor_model_parallel_size", 1, minimum=1),
        pp=layout.int("pipeline_model_parallel_size", 1, minimum=1),
        checkpoint_dir=s.str("checkpoint_dir"),
        micro_batch_size=s.int("micro_batch_size", 8, minimum=1),
        limit_batches=s.int("limit_batches", 8, minimum=1),
    )
    vpp = layout.int("virtual_pipeline_model_parallel_size", None, minimum=1)
    optional = dict(checkpoint_name=s.str("checkpoint_name", None), tokenizer_model=s.str("tokenizer_model", None),
                    max_length=s.int("max_length", None, minimum=1))
    report.error(rules.checkpoint_name(optional["checkpoint_name"], f"{p}checkpoint_name", f"{p}checkpoint_dir"))
    tasks = _tasks(s.raw("tasks", []), p, report)
    lm_eval = _lm_eval_options(s, p, report)
    if report.errors or any(v is None for v in values.values()):
        return None, report
    world = values["num_nodes"] * values["devices"]
    report.error(rules.world_divisible(world, rules.world_text(values["num_nodes"], values["devices"]),
                                       values["tp"], values["pp"], p))
    report.error(rules.tp_within_node(values["tp"], values["devices"], p))
    report.error(rules.virtual_needs_pipeline(vpp, values["pp"], p))
    generating = [spec.name for spec in tasks if spec.type == "exact_match"]
    if generating and values["pp"] > 1:
        report.error(f"{p}model.pipeline_model_parallel_size: {values['pp']}, but task {generating[0]!r} "
                     f"(exact_match) generates text, which runs at pipeline_model_parallel_size 1 only; set it to "
                     f"1 (tensor parallelism is fine) or evaluate that task in a separate run")
    if report.errors:
        return None, report
    return EvaluationConfig(virtual_pp=vpp, tasks=tasks, lm_eval=lm_eval, **values, **optional), report


def _tasks(specs: Any, p: str, report: Report) -> tuple[TaskSpec, ...]:
    if not isinstance(specs, list) or not specs:  # an evaluation of nothing would pass, having measured nothing
        report.error(f"{p}tasks: {specs!r} must be a non-empty list of task names ({', '.join(BUILTIN_TASKS)}, or "
                     f"lm-eval tasks) or mappings with a type ({TASK_TYPES.listing()})")
        return ()
    tasks = []
    for i, spec in enumerate(specs):
        key = f"{p}tasks[{i}]"
        if isinstance(spec, str):
            if spec in BUILTIN_TASKS:
                tasks.append(TaskSpec(spec, "loss", {"split": BUILTIN_TASKS[spec]}))
            elif spec.strip() and not any(c.isspace() for c in spec):  # lm-eval checks the name (lm_tasks.py)
                tasks.append(TaskSpec(spec, "lm_eval", {}))
            else:
                report.error(f"{key}: {spec!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor an lm-eval "
                             f"task name")
        elif isinstance(spec, dict):
            kind = spec.get("type")
            if problem := TASK_TYPES.problem(f"{key}.type", kind):
                report.error(problem)
                continue
            default_name = "demo_code_lines" if kind == "synthetic_demo" else kind
            options = {k: v for k, v in spec.items() if k not in ("name", "type")}
            if kind == "exact_match":
                options = _exact_match_options(spec, key, report)
                if options is None:
                    continue
            tasks.append(TaskSpec(str(spec.get("name") or default_name), kind, options))
        else:
            report.error(f"{key}: {spec!r} is neither a built-in task name nor a mapping")
    return tuple(tasks)


def _lm_eval_options(s: Section, p: str, report: Report) -> LmEvalOptions:
    limit = s.raw("limit", None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0
                              or (limit >= 1 and limit != int(limit))):
        report.error(f"{p}limit: {limit!r} must be null, a whole number of examples per task, or a fraction below 1")
        limit = None
    return LmEvalOptions(
        include_path=s.str("include_path", None), num_fewshot=s.int("num_fewshot", None, minimum=0),
        limit=None if limit is None else (int(limit) if limit >= 1 else float(limit)),
        apply_chat_template=s.bool("apply_chat_template", False),
        fewshot_as_multiturn=s.bool("fewshot_as_multiturn", True),
        bootstrap_iters=s.int("bootstrap_iters", 100_000, minimum=0), datasets_cache=s.str("datasets_cache", None))


def _exact_match_options(spec: dict, key: str, report: Report) -> dict | None:
    """{type: exact_match, path, limit, max_new_tokens, baseline, chat_template}, typed; None after an error.
    The file itself is read by runtime/evaluate/exact_match.py (an earlier stage of the launch may write it)."""
    errors = len(report.errors)
    s = Section(spec, key, report)
    s.seen.update(("name", "type"))  # read by _tasks
    options = dict(path=s.str("path"), limit=s.int("limit", None, minimum=1),
                   max_new_tokens=s.int("max_new_tokens", 64, minimum=1), baseline=s.bool("baseline", False),
                   chat_template=s.choice("chat_template", Choices((None, *C.CHAT_TEMPLATES)), None))
    s.done()
    return None if len(report.errors) > errors else options
