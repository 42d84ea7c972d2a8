"""Checks on the resolved config before anything is written or submitted. Pure functions: each returns
one line per problem, naming the key, the bad value and the fix. `problems()` returns (errors, warnings)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from launcher import staging
from launcher.slurm import slurm_seconds
from launcher.stages import PROGRAMS, STAGES

CLUSTER_TYPES = ("auto", "local", "slurm", "bcm")
DEPENDENCIES = ("afterok", "afterany", "singleton")
ARCHITECTURES = ("gpt", "llama")
ACCELERATORS = ("cpu", "gpu", "neuron")
PRECISIONS = ("fp32", "bf16SR", "mixed_precision", "mixed_precisionSR", "autocast")
CHECKPOINT_GRANULARITIES = (None, "full", "selective")

# Keys of the cluster group that become #SBATCH lines, and the other keys the group may hold.
SBATCH_KEYS = ("partition", "account", "exclusive", "mem", "gres", "exclude", "nodelist", "qos", "reservation")
OTHER_CLUSTER_KEYS = ("job_name_prefix", "srun_args", "setup", "env_vars", "workers_per_node",
                      "neuron", "remote", "staging")  # checked by neuron.py, remote.py, staging.py

# Slurm's own time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
# What may stand in an #SBATCH line: sbatch reads those lines itself, so nothing there may need quoting.
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%+=/\[\]-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# run_name and base_results_dir end up in #SBATCH --output paths and in job names.
_PATH_UNSAFE = re.compile(r"[\s'\"\\]")


def problems(cfg: dict[str, Any], *, dry_run: bool) -> tuple[list[str], list[str]]:
    errors: list[str] = []
    warnings: list[str] = []
    errors += _top_level(cfg)
    # A stage whose program is missing is already reported; its own checks would only add noise.
    stages = [s for s in cfg.get("stages") or [] if s in STAGES and importlib.util.find_spec(PROGRAMS[s])]
    for stage in stages:
        errors += _stage_run(cfg[stage]["run"], stage)
    if "training" in stages:
        errors += training(cfg["training"])
        errors += preemption(cfg["training"]["run"])
        missing = training_paths(cfg["training"], prepared_in_this_run="data_preparation" in stages)
        # A dry run often renders on a laptop for a cluster whose file system it cannot see.
        (warnings if dry_run else errors).extend(missing)
    # Inputs on S3 are staged inside the job; staging.problems checks their names, the job the rest.
    if "data_preparation" in stages and not staging.s3_values(cfg["data_preparation"]):
        errors += _data_preparation(cfg["data_preparation"])
    errors += cluster(cfg.get("cluster") or {})
    return errors, warnings


def _top_level(cfg: dict[str, Any]) -> list[str]:
    errors = []
    stages = cfg.get("stages")
    if not isinstance(stages, list) or not stages:
        errors.append(f"stages: must be a non-empty list such as stages=[training] (valid: {', '.join(STAGES)})")
        stages = []
    for stage in stages:
        if stage not in STAGES:
            errors.append(f"stages: unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")
        elif importlib.util.find_spec(PROGRAMS[stage]) is None:
            errors.append(
                f"stages: {stage!r} needs {PROGRAMS[stage]}, which this version does not have yet; "
                "leave it out of stages"
            )
    if len(set(stages)) != len(stages):
        errors.append(f"stages: {stages} names a stage twice; list each stage once")
    if cfg.get("cluster_type") not in CLUSTER_TYPES:
        errors.append(f"cluster_type: {cfg.get('cluster_type')!r} is not one of {', '.join(CLUSTER_TYPES)}")
    name = str(cfg.get("run_name") or "")
    if not name or "/" in name or _PATH_UNSAFE.search(name) or not name.isprintable():
        errors.append(
            f"run_name: {name!r} must be non-empty, without '/', spaces, quotes or backslashes "
            "(it names a directory and Slurm jobs); e.g. run_name=my_run"
        )
    for key in ("base_results_dir", "data_dir"):
        value = str(cfg.get(key) or "")
        if key == "data_dir" and value.startswith("s3://"):
            continue  # staged to cluster.staging.local_dir; staging.problems checks it
        if not value.startswith("/") or _PATH_UNSAFE.search(value) or not value.isprintable():
            errors.append(
                f"{key}: {value!r} must be an absolute path without spaces, quotes or backslashes; "
                f"e.g. {key}=/fsx/{key}"
            )
    errors += _env_vars(cfg.get("env_vars"), "env_vars")
    return errors


def _env_vars(env: Any, key: str) -> list[str]:
    if env is None:
        return []
    if not isinstance(env, dict):
        return [f"{key}: must be a mapping of NAME: value, e.g. {key}.NCCL_DEBUG=INFO"]
    return [
        f"{key}.{name}: {name!r} is not a valid environment variable name (letters, digits, _)"
        for name in env
        if not _ENV_NAME.match(str(name))
    ]


def _stage_run(run: dict[str, Any], stage: str) -> list[str]:
    errors = []
    if not _TIME.match(str(run.get("time_limit"))):
        errors.append(
            f"{stage}.run.time_limit: {run.get('time_limit')!r} is not a Slurm time; "
            "use H:MM:SS or D-HH:MM:SS, e.g. 4:00:00"
        )
    results_dir = str(run.get("results_dir") or "")
    if not results_dir.startswith("/") or _PATH_UNSAFE.search(results_dir) or not results_dir.isprintable():
        errors.append(f"{stage}.run.results_dir: {results_dir!r} must be an absolute path without spaces, "
                      "quotes or backslashes (it appears in #SBATCH lines)")
    if (run.get("dependency") or "afterok") not in DEPENDENCIES:
        errors.append(f"{stage}.run.dependency: {run.get('dependency')!r} is not one of {', '.join(DEPENDENCIES)}")
    return errors


def preemption(run: dict[str, Any]) -> list[str]:
    """training.run.preemption_signal_s and max_restarts: what the job script does before the time limit."""
    errors = []
    signal_s, restarts = run.get("preemption_signal_s"), run.get("max_restarts")
    if signal_s is not None and (not isinstance(signal_s, int) or isinstance(signal_s, bool)
                                 or not 0 <= signal_s <= 65535):
        errors.append(f"training.run.preemption_signal_s: {signal_s!r} must be whole seconds from 0 to 65535 "
                      "(how long before run.time_limit Slurm signals the job; 0 or null: no signal)")
    elif signal_s and _TIME.match(str(run.get("time_limit"))):
        limit_s = slurm_seconds(str(run["time_limit"]))
        if limit_s is not None and signal_s >= limit_s:
            errors.append(f"training.run.preemption_signal_s: {signal_s} s is not shorter than run.time_limit "
                          f"{run['time_limit']} ({limit_s} s): every run would be signalled as it starts; "
                          "use fewer seconds")
    if restarts is not None and (not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0):
        errors.append(f"training.run.max_restarts: {restarts!r} must be a non-negative integer "
                      "(how often the job may requeue itself; 0: never)")
    return errors


def _positive_ints(section: dict[str, Any], prefix: str, keys: tuple[str, ...]) -> list[str]:
    return [
        f"{prefix}.{key}: {section.get(key)!r} must be a positive integer"
        for key in keys
        if not isinstance(section.get(key), int) or isinstance(section.get(key), bool) or section.get(key) < 1
    ]


def training(stage: dict[str, Any]) -> list[str]:
    """The arithmetic every parallel layout must satisfy; the messages show it."""
    trainer, model = stage["trainer"], stage["model"]
    errors = _positive_ints(trainer, "training.trainer", ("num_nodes", "devices", "max_steps"))
    errors += _positive_ints(
        model, "training.model",
        ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
         "num_layers", "hidden_size", "num_attention_heads", "encoder_seq_length"),
    )
    vpp = model.get("virtual_pipeline_model_parallel_size")
    if vpp is not None:
        errors += _positive_ints(model, "training.model", ("virtual_pipeline_model_parallel_size",))
    if errors:
        return errors  # the arithmetic below needs sane numbers

    m = "training.model."
    nodes, devices = trainer["num_nodes"], trainer["devices"]
    tp, pp = model["tensor_model_parallel_size"], model["pipeline_model_parallel_size"]
    world = nodes * devices
    if world % (tp * pp):
        errors.append(
            f"training: num_nodes × devices = {nodes} × {devices} = {world} is not divisible by "
            f"tensor_model_parallel_size × pipeline_model_parallel_size = {tp} × {pp} = {tp * pp}; "
            "change the node count or the parallel sizes"
        )
    else:
        dp = world // (tp * pp)
        mbs, gbs = model["micro_batch_size"], model["global_batch_size"]
        if gbs % (mbs * dp):
            errors.append(
                f"{m}global_batch_size: {gbs} is not divisible by micro_batch_size × data-parallel size = "
                f"{mbs} × {dp} = {mbs * dp} (data-parallel size = {world} workers / (tp {tp} × pp {pp})); "
                f"use a multiple of {mbs * dp}"
            )
        elif vpp and (gbs // (mbs * dp)) % pp:
            errors.append(
                f"{m}virtual_pipeline_model_parallel_size: the interleaved schedule needs the micro-batch count "
                f"({gbs // (mbs * dp)}) to be a multiple of pipeline_model_parallel_size ({pp})"
            )
    heads = model["num_attention_heads"]
    if heads % tp:
        errors.append(f"{m}num_attention_heads: {heads} is not divisible by tensor_model_parallel_size {tp}")
    if model["hidden_size"] % heads:
        errors.append(f"{m}hidden_size: {model['hidden_size']} is not divisible by num_attention_heads {heads}")
    groups = model.get("num_query_groups") or heads
    if heads % groups:
        errors.append(f"{m}num_query_groups: {groups} does not divide num_attention_heads {heads}")
    elif groups % tp and tp % groups:
        errors.append(
            f"{m}num_query_groups: {groups} KV heads can be neither split over nor replicated to "
            f"tensor_model_parallel_size {tp}; one must divide the other"
        )
    layers = model["num_layers"]
    chunks = pp * (vpp or 1)
    if layers % chunks:
        errors.append(
            f"{m}num_layers: {layers} is not divisible by pipeline_model_parallel_size × "
            f"virtual_pipeline_model_parallel_size = {pp} × {vpp or 1} = {chunks}"
        )
    if vpp and pp == 1:
        errors.append(f"{m}virtual_pipeline_model_parallel_size: needs pipeline_model_parallel_size > 1, or null")
    sched = (model.get("optim") or {}).get("sched") or {}
    warmup, constant = int(sched.get("warmup_steps") or 0), int(sched.get("constant_steps") or 0)
    if warmup + constant > trainer["max_steps"]:
        errors.append(
            f"{m}optim.sched.warmup_steps: warmup_steps {warmup} + constant_steps {constant} exceeds "
            f"trainer.max_steps {trainer['max_steps']}; shorten the warmup or train longer"
        )
    errors += _choice(model.get("architecture"), ARCHITECTURES, f"{m}architecture")
    errors += _choice(trainer.get("accelerator"), ACCELERATORS, "training.trainer.accelerator")
    errors += _choice((stage.get("precision") or {}).get("type"), PRECISIONS, "training.precision.type")
    errors += _choice(
        model.get("activations_checkpoint_granularity"), CHECKPOINT_GRANULARITIES,
        f"{m}activations_checkpoint_granularity",
    )
    return errors


def _choice(value: Any, valid: tuple, key: str) -> list[str]:
    if value in valid:
        return []
    names = ", ".join("null" if v is None else str(v) for v in valid)
    return [f"{key}: {value!r} is not one of {names}"]


def training_paths(stage: dict[str, Any], *, prepared_in_this_run: bool) -> list[str]:
    """Inputs the training stage reads. Skipped when this launch's data_preparation stage makes them."""
    if prepared_in_this_run:
        return []
    model = stage["model"]
    missing = []
    tokenizer = (model.get("tokenizer") or {}).get("model")
    if tokenizer and not staging.is_s3(tokenizer) and not Path(tokenizer).exists():
        missing.append(
            f"training.model.tokenizer.model: {tokenizer} does not exist; run stages=[data_preparation,training] "
            "or point it at a tokenizer.json"
        )
    prefix = (model.get("data") or {}).get("data_prefix")
    if isinstance(prefix, str):
        if not staging.is_s3(prefix) and not Path(prefix).exists():
            missing.append(
                f"training.model.data.data_prefix: blend file {prefix} does not exist; "
                "run the data_preparation stage first or give [weight, prefix, ...]"
            )
    elif isinstance(prefix, list):
        for path in prefix[1::2]:
            if not staging.is_s3(path) and not Path(f"{path}.idx").exists():
                missing.append(f"training.model.data.data_prefix: {path}.idx does not exist")
    return missing


def _data_preparation(stage: dict[str, Any]) -> list[str]:
    from runtime.data_prep.plan import check_inputs  # torch-free by contract

    return check_inputs(stage)


def cluster(section: dict[str, Any]) -> list[str]:
    errors = []
    known = SBATCH_KEYS + OTHER_CLUSTER_KEYS
    for key in section:
        if key not in known:
            errors.append(f"cluster.{key}: unknown key; valid keys: {', '.join(known)}")
    for key in SBATCH_KEYS:
        value = section.get(key)
        values = value if isinstance(value, list) else [] if value is None or isinstance(value, bool) else [value]
        for item in values:
            if not _SBATCH_VALUE.match(str(item)):
                errors.append(
                    f"cluster.{key}: {item!r} is not a Slurm value (letters, digits and _.,:@%+=/[]- only)"
                )
    for key in ("srun_args", "setup", "exclude", "nodelist"):
        if not isinstance(section.get(key, []), list):
            errors.append(f"cluster.{key}: must be a list, e.g. cluster.{key}=[a,b]")
    errors += _env_vars(section.get("env_vars"), "cluster.env_vars")
    return errors
