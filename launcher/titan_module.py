"""The torchtitan job module of a training stage, rendered from its context (docs: issue 60, contract 1) by
templates/torchtitan/job.py.j2. Pure and torch-free: the same context always gives the same text, and nothing is
written here. Every value reaches the module through repr(), so a path or a name is a Python literal, never code.

The context is plain JSON-able data (launcher/titan.py builds it from a validated training config); a value of
None leaves torchtitan's default in place (the module lists those keys in a closing comment). Besides contract 1's
keys it reads an optional `launch` (the launch's name) for the module's first line, and an optional `vocabulary`
({"tokenizer": path, "divisible_by": N}) where model.vocab_size is None: the job reads the tokenizer's size then."""
from __future__ import annotations

import textwrap
from functools import lru_cache
from typing import Any

from launcher.paths import templates_dir
from runtime.schema.families import torchtitan_builder

TEMPLATE = "torchtitan/job.py.j2"
ACTIVATION_CHECKPOINT = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}

# (ctx section, Trainer.Config field, its class in the module, the ctx keys it takes). The training section's
# seed and deterministic are torchtitan's debug.* (DebugConfig); the dataloader takes the batch size and steps too.
SECTIONS = (
    ("training", "training", "TrainingConfig",
     ("local_batch_size", "global_batch_size", "seq_len", "steps", "max_norm", "mixed_precision_param",
      "mixed_precision_reduce")),
    ("parallelism", "parallelism", "ParallelismConfig",
     ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
      "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
      "context_parallel_degree", "expert_parallel_degree")),
    ("lr_scheduler", "lr_scheduler", "LRSchedulersContainer.Config",
     ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")),
    ("checkpoint", "checkpoint", "CheckpointManager.Config",
     ("enable", "folder", "interval", "keep_latest_k", "initial_load_path", "initial_load_model_only")),
    ("compile", "compile", "CompileConfig", ("enable", "components")),
    ("metrics", "metrics", "JsonlMetricsProcessor.Config", ("log_freq",)),
    ("comm", "comm", "CommConfig", ("init_timeout_seconds", "train_timeout_seconds")),
    ("training", "debug", "DebugConfig", ("seed", "deterministic")),
)
# Values the launch does not choose, and why (the module shows the why above its section).
FIXED = {"parallelism": [("spmd_backend", "partial_dtensor")], "checkpoint": [("last_save_model_only", False)]}
NOTES = {
    "parallelism": "spmd_backend: torchtitan's default (spmd_types) hands FSDP plain tensors, which torch 2.13's "
                   "fully_shard refuses; DTensor on the model-parallel axes is the path that trains.",
    "checkpoint": "last_save_model_only=False: the last checkpoint resumes like any other, as our runtime's do.",
}
REQUIRED = ("family", "model", "parallelism", "training", "optimizer", "lr_scheduler", "checkpoint",
            "activation_checkpoint", "compile", "data", "dump_folder", "metrics", "comm")


@lru_cache(maxsize=1)
def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["r"] = repr
    # A newline inside a comment would start a line of code.
    env.filters["comment"] = lambda value: str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return env


def render_module(ctx: dict[str, Any]) -> str:
    """The job module's text for this context (ValueError naming a missing or unknown key)."""
    missing = [key for key in REQUIRED if key not in ctx]
    if missing:
        raise ValueError(f"torchtitan job context: missing {', '.join(missing)}")
    torchtitan_builder(ctx["family"])  # ValueError naming the models torchtitan trains here
    if ctx["activation_checkpoint"] not in ACTIVATION_CHECKPOINT:
        raise ValueError(f"activation_checkpoint: {ctx['activation_checkpoint']!r}; choose one of "
                         f"{tuple(ACTIVATION_CHECKPOINT)}")
    _check_keys(ctx)
    defaults: list[str] = []
    sections = []
    for source, field, class_name, keys in SECTIONS:
        fields = _given(ctx[source], keys, source, defaults)
        fields += FIXED.get(field, [])
        sections.append((field, class_name, fields, textwrap.wrap(NOTES.get(field, ""), 100)))
    training, data, optimizer = ctx["training"], ctx["data"], ctx["optimizer"]
    dataloader = [("blend", [(float(weight), str(prefix)) for weight, prefix in data["blend"]])]
    dataloader += _given(data, ("seed", "splits_string", "index_dir"), "data", defaults)
    dataloader += [("global_batch_size", training["global_batch_size"]), ("steps", training["steps"])]
    optimizer_kwargs = {"lr": optimizer.get("lr"), "eps": optimizer.get("eps"),
                        "weight_decay": optimizer.get("weight_decay")}
    if optimizer.get("beta1") is not None and optimizer.get("beta2") is not None:
        optimizer_kwargs["betas"] = (optimizer["beta1"], optimizer["beta2"])
    model = [(key, value) for key, value in ctx["model"].items() if value is not None and key != "vocab_size"]
    vocabulary = ctx.get("vocabulary")  # {"tokenizer", "divisible_by"} where the launch did not know the vocabulary
    if (ctx["model"]["vocab_size"] is None) == (vocabulary is None):
        raise ValueError("torchtitan job context: give model.vocab_size or vocabulary (the tokenizer to read it from)")
    return _environment().get_template(TEMPLATE).render(
        launch=ctx.get("launch") or f"writing to {ctx['dump_folder']}",
        family=ctx["family"], model=model, vocab_size=ctx["model"]["vocab_size"], vocabulary=vocabulary,
        dataloader=dataloader,
        optimizer_name=optimizer.get("name") or "AdamW",
        optimizer_kwargs={key: value for key, value in optimizer_kwargs.items() if value is not None},
        sections=sections, activation_checkpoint=ACTIVATION_CHECKPOINT[ctx["activation_checkpoint"]],
        dump_folder=ctx["dump_folder"],
        defaults=textwrap.wrap("Left to torchtitan's defaults (the launch gave no value): " + ", ".join(defaults) + ".",
                               110) if defaults else [],
    )


def _given(section: dict[str, Any], keys: tuple[str, ...], name: str, defaults: list[str]) -> list[tuple]:
    """(key, value) for each key the section gives a value; the others are noted in `defaults`."""
    given = []
    for key in keys:
        if section.get(key) is None:
            defaults.append(f"{name}.{key}")
        else:
            given.append((key, section[key]))
    return given


def _check_keys(ctx: dict[str, Any]) -> None:
    """ValueError naming a key of a section that the module would silently drop."""
    allowed: dict[str, set[str]] = {
        "model": {"dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size", "rope_theta", "norm_eps",
                  "max_seq_len", "head_dim", "qk_norm", "tie_embeddings", "rope_scaling"},
        "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay"},
        "data": {"blend", "seed", "splits_string", "index_dir"},
    }
    for source, _, _, keys in SECTIONS:
        allowed.setdefault(source, set()).update(keys)
    for name, keys in allowed.items():
        unknown = set(ctx[name]) - keys
        if unknown:
            raise ValueError(f"torchtitan job context: {name} has no key {', '.join(sorted(unknown))}; it takes "
                             f"{', '.join(sorted(keys))}")
