"""The training stage under training.runtime=torchtitan: what a launch refuses, and the context (`ctx`, contract 1
of docs/torchtitan.md) the generated module is rendered from (launcher/titan_module.py render_module). Every key
of the stage has its fate in launcher/titan_keys.py; here are the values: the family, the layout, the batch, the
optimizer and its schedule, the checkpoints and the data, from the stage's validated config (runtime/schema).

Data parallelism, as torchtitan's HSDP: the dp ranks a node holds shard the model (FSDP, data_parallel_shard_degree),
and the nodes replicate it (data_parallel_replicate_degree), so that parameter gathers stay on the node's links.
One node, or a tensor x context group that fills a node: every dp rank shards (FSDP across nodes). Our ZeRO-1 and
ZeRO-2 shard less than FSDP (optimizer state, gradients); what is trained is the same.

The learning rate: NeMo's schedule (runtime/optim_schedule.py) warms up over warmup_steps + 1 steps and decays over
the rest; torchtitan's (torchtitan/components/optimizer/lr_scheduler.py) warms up over its warmup_steps, then holds
one "virtual" step before its decay. With warmup_steps + 1 the warmups are equal step for step, and torchtitan's
decay starts one step later and ends at the same step: its rate lies between ours at the step and ours a step before
(equal throughout when warmup_steps is 0; tests/launcher/test_titan_launch.py runs both). NeMo's constant_steps (a
final hold at min_lr) has no counterpart and is refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from launcher.config import LaunchConfig, stage_inputs
from launcher.stages import runs_torchtitan
from launcher.titan_keys import KEYS, asks_for_more, key_of
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import TrainingConfig
from runtime.titan.shape import OPTIMIZERS, USE_NXDT, titan_model, titan_shape

PRECISIONS = {"fp32": "float32", "mixed_precision": "bfloat16", "autocast": "bfloat16"}
DECAY = {"CosineAnnealing": "cosine", "LinearAnnealing": "linear", "Constant": "linear"}
UNKNOWN_SHAPE = ("training.model: the model's shape is not known here (model.model_config's config.json is not on "
                 "this machine), so the torchtitan job cannot be generated; give its path")


def family(model: ModelConfig) -> tuple[str | None, str]:
    """(torchtitan's model, or None and why not), as runtime/titan/shape.py judges it, with this table's reasons."""
    return titan_model(model, why=lambda key: KEYS["model." + key].why)


def once_per_key(lines: list[str]) -> list[str]:
    """The first line about each key (a key set in the YAML is named by its value and by the model it makes)."""
    seen, kept = set(), []
    for line in lines:
        key = line.split(":", 1)[0]
        if key not in seen:
            seen.add(key)
            kept.append(line)
    return kept


def data_parallel(config: TrainingConfig) -> dict[str, int]:
    """The data-parallel degrees (see the top): model.data_parallel_shard_degree where the recipe sets it (the
    schema has checked it divides dp), else shard within a node and replicate across nodes."""
    layout, trainer = config.parallel, config.trainer
    inner = layout.tp * layout.context
    dp = trainer.num_nodes * trainer.devices // (inner * layout.pp)
    per_node = trainer.devices // inner if trainer.devices % inner == 0 else 0
    shard = layout.shard_degree or (per_node if 1 < per_node < dp and dp % per_node == 0 else dp)
    return {"data_parallel_replicate_degree": dp // shard, "data_parallel_shard_degree": shard}


def _schedule(config: TrainingConfig) -> dict[str, Any]:
    optim, sched = config.optim, config.optim.sched
    return {
        "warmup_steps": sched.warmup_steps + 1 if sched.warmup_steps else 0,
        "decay_ratio": None,
        "decay_type": DECAY[sched.name],
        "min_lr_factor": 1.0 if sched.name == "Constant" else sched.min_lr / optim.lr,
    }


def _blend(data_prefix: Any) -> list[list[Any]]:
    """[[weight, prefix], ...]: a [w1, p1, ...] list as it is, a blend file read when it is here; otherwise (a
    prefix, or a blend file this launch's data_preparation writes) the one path, weight 1, which the job's dataset
    reads as data_prefix.parse_data_prefix does (a blend file or a prefix)."""
    from runtime.schema.data_prefix import parse_data_prefix

    if isinstance(data_prefix, str) and not Path(data_prefix).is_file():
        return [[1.0, data_prefix]]
    try:
        return [[entry.weight, entry.prefix] for entry in parse_data_prefix(data_prefix)]
    except ValueError:
        return [[1.0, str(data_prefix)]]


def context(config: TrainingConfig, *, vocabulary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The generated module's context (contract 1): every value torchtitan-native, None where its default applies.
    `config` is the stage's validated config; problems() has refused what has no counterpart."""
    name, _ = family(config.model)
    layout, data, checkpoint = config.parallel, config.data, config.checkpoint
    dp = data_parallel(config)
    piped = layout.pp > 1
    steps = config.trainer.max_steps
    ft = config.fault_tolerance
    return {
        "launch": config.run_name,  # launcher/titan_module.py's optional first-line name
        "family": name,
        "model": titan_shape(config.model, vocab_known=vocabulary is None),
        # Where the vocabulary is not known here, the job reads it from the tokenizer and pads it as our runtime.
        "vocabulary": vocabulary,
        "parallelism": {
            **dp, "tensor_parallel_degree": layout.tp, "pipeline_parallel_degree": layout.pp,
            "pipeline_parallel_schedule": "1F1B" if piped else None,
            "pipeline_parallel_microbatch_size": data.micro_batch_size if piped else None,
            "context_parallel_degree": layout.cp, "expert_parallel_degree": layout.ep,
        },
        "training": {
            # Under pipeline parallelism a step's microbatches all go through the pipeline: the rank's whole batch.
            "local_batch_size": (data.global_batch_size // (dp["data_parallel_replicate_degree"]
                                                            * dp["data_parallel_shard_degree"])
                                 if piped else data.micro_batch_size),
            "global_batch_size": data.global_batch_size, "seq_len": data.seq_length, "steps": steps,
            "max_norm": config.trainer.gradient_clip_val,
            "mixed_precision_param": PRECISIONS[config.precision.type], "mixed_precision_reduce": "float32",
            "seed": config.seed, "deterministic": None,
        },
        "optimizer": {"name": OPTIMIZERS[config.optim.name], "lr": config.optim.lr, "beta1": config.optim.betas[0],
                      "beta2": config.optim.betas[1], "eps": config.optim.eps,
                      "weight_decay": config.optim.weight_decay},
        "lr_scheduler": _schedule(config),
        "checkpoint": {
            "enable": checkpoint.enabled, "folder": checkpoint.dirpath,
            "interval": checkpoint.every_n_train_steps or steps,
            "keep_latest_k": 0 if checkpoint.save_top_k < 0 else max(checkpoint.save_top_k, 2),
            "initial_load_path": None, "initial_load_model_only": None,
        },
        "activation_checkpoint": layout.activation_checkpointing or "none",
        "compile": {"enable": False, "components": None},
        "data": {"blend": _blend(data.data_prefix), "seed": config.seed, "splits_string": data.splits_string,
                 "index_dir": data.index_mapping_dir},
        "dump_folder": str(config.results_dir),
        "metrics": {"log_freq": config.trainer.log_every_n_steps},
        "comm": {"init_timeout_seconds": int(ft.setup_timeout_s) if ft else None,
                 "train_timeout_seconds": int(ft.step_timeout_s) if ft and ft.step_timeout_s else None},
    }


def value_problems(config: TrainingConfig) -> list[str]:
    """The values of mapped keys that torchtitan cannot take (one line each, naming the key and what to do)."""
    p = "training."
    problems = [family(config.model)[1]]
    if config.precision.type not in PRECISIONS:
        problems.append(f"{p}precision.type: {config.precision.type} (stochastic rounding) has no torchtitan "
                        f"counterpart; use {', '.join(PRECISIONS)} {USE_NXDT}")
    if config.optim.name not in OPTIMIZERS:
        problems.append(f"{p}model.optim.name: {config.optim.name} has no counterpart in the generated job; use "
                        f"adamw or adam {USE_NXDT}")
    if config.trainer.gradient_clip_val == 0:
        problems.append(f"{p}trainer.gradient_clip_val: 0 (no clipping) has no torchtitan counterpart (its "
                        f"training.max_norm always clips); set a norm, e.g. {p}trainer.gradient_clip_val=1.0")
    if config.optim.sched.max_steps != config.trainer.max_steps:
        problems.append(f"{p}model.optim.sched.max_steps: {config.optim.sched.max_steps}, but torchtitan's schedule "
                        f"spans training.steps ({p}trainer.max_steps {config.trainer.max_steps}); unset it")
    if (vpp := config.parallel.virtual_pp) not in (None, 1):
        problems.append(f"{p}model.virtual_pipeline_model_parallel_size: {vpp}; "
                        f"{KEYS['model.virtual_pipeline_model_parallel_size'].why}")
    if config.parallel.ep != 1:
        problems.append(f"{p}model.expert_model_parallel_size: {config.parallel.ep}, but the torchtitan families "
                        f"here are dense; set it to 1 {USE_NXDT}")
    return [problem for problem in problems if problem]


def key_problems(flat: dict[str, Any], stage: str = "training") -> tuple[list[str], list[str]]:
    """(refused keys, one line each; named keys, in one warning line) of a stage's flattened keys."""
    refused, named = [], []
    for key, value in flat.items():
        entry = key_of(key)
        if not asks_for_more(entry, value):
            continue
        if entry is not None and entry.fate == "named":
            named.append(key)
        else:
            why = entry.why if entry else f"no torchtitan counterpart is known for it; unset it {USE_NXDT}"
            refused.append(f"{stage}.{key}: {value!r} with training.runtime=torchtitan: {why}")
    lines = [f"training.runtime=torchtitan: no effect in the torchtitan job: {', '.join(named)} (nxdt-launch "
             f"explain-config --runtime torchtitan says why each)"] if named else []
    return refused, lines


def target_problems(cfg: LaunchConfig) -> list[str]:
    """Trn1 has no TorchNeuron: torchtitan does not run there (a Neuron cluster is trn1 unless it says trn2)."""
    from launcher import neuron

    if cfg.cluster.neuron is not None and neuron.settings(cfg.cluster)["hardware"] == "trn1":
        return ["training.runtime: torchtitan on Trn1 (cluster.neuron.hardware trn1): Trn1 has no TorchNeuron; it "
                "stays on Neuron 2.28 with torch-xla, which is nxdt-launch's runtime: use training.runtime=nxdt "
                "(torchtitan runs on Trn2 clusters, CPU and GPU)"]
    return []


def typed_config(section: dict[str, Any]) -> tuple[TrainingConfig | None, dict[str, Any] | None, list[str]]:
    """(the stage's validated config, the vocabulary the job must read where it is not known here, errors). Without
    the tokenizer (made by this launch's data_preparation, or on a cluster's file system) the vocabulary stands in at
    a size every layout takes, and the job reads the tokenizer's, padded to make_vocab_size_divisible_by:
    {"tokenizer": path, "divisible_by": N} (None when the vocabulary is known here)."""
    from runtime.schema.training import parse_training, tokenizer_vocab

    inputs = stage_inputs(section)
    path = str(inputs.tokenizer or "")
    vocab = tokenizer_vocab(path, files="warn")[0] if path and Path(path).is_file() else None
    model = inputs.model_without_data
    divisible_by, tp = (size if isinstance(size, int) and size > 0 else 1  # the schema judges other values
                        for size in (model.get("make_vocab_size_divisible_by") or 128,
                                     model.get("tensor_model_parallel_size") or 1))
    config, report = parse_training(section, files="warn", prepared=True,
                                    vocab_size=vocab or math.lcm(divisible_by, tp))
    # A config.json's vocab_size is the model's whatever the tokenizer (unpadded_vocab_size records it).
    known = vocab is not None or (config is not None and config.model.unpadded_vocab_size is not None)
    return config, None if known else {"tokenizer": path, "divisible_by": divisible_by}, report.errors


def problems(cfg: LaunchConfig) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a launch whose training stage runs torchtitan; nothing for one that does not."""
    from launcher.nxdt_keys import flatten

    if "training" not in cfg.stages or "training" not in cfg.sections:
        return [], []
    section = cfg.stage("training").section
    if not runs_torchtitan(section):
        return [], []
    refused, named = key_problems(flatten(section))
    errors = target_problems(cfg) + refused
    config, _, parse_errors = typed_config(section)
    if config is not None:
        errors += value_problems(config)
    elif not parse_errors:
        errors.append(UNKNOWN_SHAPE)
    return once_per_key(errors), named


def module_text(section: dict[str, Any]) -> str:
    """The generated module's text for the stage config (launch.py writes it as stages.TITAN_MODULE in the launch
    directory). titan_module is imported here, when a torchtitan job is written, and not before."""
    from launcher.titan_module import render_module

    config, vocabulary, errors = typed_config(section)
    assert config is not None, f"validated before any file is written: {errors}"
    return render_module(context(config, vocabulary=vocabulary))


def _at(ctx: dict[str, Any] | None, dotted: str) -> Any:
    node: Any = ctx
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def explain(section: dict[str, Any]) -> tuple[list[tuple[str, Any, str]], list[str], list[str]]:
    """(rows, refused, named) of a training stage config, key by key: what each becomes in the torchtitan job
    (the context's key and value), or its fate and why (launcher/titan_keys.py); refused holds one line per key or
    value the job cannot take, named the keys set to what has no effect there. explain-config --runtime torchtitan
    prints it; a launch checks the same (problems)."""
    from launcher.nxdt_keys import flatten

    flat = flatten(section)
    refused, named_line = key_problems(flat)
    config, vocabulary, errors = typed_config(section)
    ctx = context(config, vocabulary=vocabulary) if config is not None and not family(config.model)[1] else None
    refused = once_per_key(refused + (value_problems(config) if config is not None else errors or [UNKNOWN_SHAPE]))
    rows = []
    for key, value in flat.items():
        entry = key_of(key)
        if entry is None:
            text = "refused: no torchtitan counterpart" if asks_for_more(entry, value) else "unused (empty)"
        elif entry.fate == "maps":
            shown = _at(ctx, entry.titan) if entry.titan else None
            text = f"{entry.titan}" + (f" = {shown!r}" if shown is not None and not isinstance(shown, dict) else "")
            text += f" ({entry.why})" if entry.why else ""
        elif entry.fate in ("named", "refused") and not asks_for_more(entry, value):
            text = f"{entry.fate} if set; at its default here: {entry.why}"
        else:
            text = f"{entry.fate}: {entry.why}"
        rows.append((f"training.{key}", value, text))
    named = [key for key, value in flat.items() if (e := key_of(key)) is not None and e.fate == "named"
             and asks_for_more(e, value)]
    assert bool(named) == bool(named_line)
    return rows, refused, named
