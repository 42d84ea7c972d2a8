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
from runtime.schema.families import TORCHTITAN_MODELS, torchtitan_model
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import TrainingConfig

FAMILIES = tuple(TORCHTITAN_MODELS.values())
PRECISIONS = {"fp32": "float32", "mixed_precision": "bfloat16", "autocast": "bfloat16"}
OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
DECAY = {"CosineAnnealing": "cosine", "LinearAnnealing": "linear", "Constant": "linear"}
USE_NXDT = "or set training.runtime=nxdt"
UNKNOWN_SHAPE = ("training.model: the model's shape is not known here (model.model_config's config.json is not on "
                 "this machine), so the torchtitan job cannot be generated; give its path")


# What our llama architecture can hold and neither torchtitan family has, read from the typed model (a config.json
# sets these as well as the YAML): the key, and whether the model asks for it.
_MODEL_EXTRAS = (("moe", lambda m: m.moe is not None), ("rope_scaling", lambda m: m.rope_scaling is not None),
                 ("add_qkv_bias", lambda m: m.add_qkv_bias),
                 ("latent_attention", lambda m: m.latent_attention is not None),
                 ("sliding_window", lambda m: m.sliding_window is not None or m.layer_types is not None),
                 ("softmax_scale", lambda m: m.softmax_scale is not None),
                 *((key, lambda m, key=key: getattr(m, key) > 0)
                   for key in ("hidden_dropout", "attention_dropout", "ffn_dropout")))


def family(model: ModelConfig) -> tuple[str | None, str]:
    """(torchtitan's model, or None and why not): torchtitan 0.3's Llama 3 and dense Qwen3 at our model's shape (the
    registry's TORCHTITAN_MODELS), without what neither has (_MODEL_EXTRAS)."""
    for key, asks in _MODEL_EXTRAS:
        if asks(model):
            value = getattr(model, key)
            shown = value if isinstance(value, (bool, int, float)) else "set (by the YAML or config.json)"
            return None, f"training.model.{key}: {shown}; {KEYS['model.' + key].why}"
    name = torchtitan_model(model)
    if name is None:
        return None, (f"training.model.architecture: {model.architecture} has no torchtitan counterpart here; the "
                      f"families both runtimes share are {' and '.join(FAMILIES)} (Llama 3 and dense Qwen3 shapes): "
                      f"choose such a recipe (training=llama3/8b, training=qwen3/8b) {USE_NXDT}")
    if not model.qk_layernorm and model.kv_channels not in (None, model.hidden_size // model.num_attention_heads):
        return None, (f"training.model.kv_channels: {model.kv_channels} without qk_layernorm: torchtitan's Llama 3 "
                      f"heads are hidden_size / num_attention_heads; unset it {USE_NXDT}")
    return name, ""


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
    """The data-parallel degrees (see the top): shard within a node, replicate across nodes."""
    layout, trainer = config.parallel, config.trainer
    inner = layout.tp * layout.context
    dp = trainer.num_nodes * trainer.devices // (inner * layout.pp)
    per_node = trainer.devices // inner if trainer.devices % inner == 0 else 0
    shard = per_node if 1 < per_node < dp and dp % per_node == 0 else dp
    return {"data_parallel_replicate_degree": dp // shard, "data_parallel_shard_degree": shard}


def _model(model: ModelConfig, vocab_known: bool) -> dict[str, Any]:
    qk_norm = model.qk_layernorm  # Qwen3's: its own head size, q/k norms
    return {
        "dim": model.hidden_size, "n_layers": model.num_layers, "n_heads": model.num_attention_heads,
        "n_kv_heads": model.kv_heads, "hidden_dim": model.ffn_hidden_size,
        # Our embedding's rows but the ones we pad a source model with (a config.json's vocab_size is torchtitan's:
        # it pads nothing), as checkpoint conversion builds torchtitan's model (runtime/convert/titan_model.py); None
        # where the tokenizer is not here yet (made by this launch's data_preparation): the job reads it then.
        "vocab_size": (model.padding_from or model.vocab_size) if vocab_known else None,
        "rope_theta": model.rotary_base, "norm_eps": model.layernorm_epsilon,
        "max_seq_len": model.max_position_embeddings,
        "head_dim": model.head_dim if qk_norm else None, "qk_norm": True if qk_norm else None,
        "tie_embeddings": model.share_embeddings_and_output_weights,
    }


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


def context(config: TrainingConfig, *, vocab_known: bool = True) -> dict[str, Any]:
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
        "model": _model(config.model, vocab_known),
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


def typed_config(section: dict[str, Any]) -> tuple[TrainingConfig | None, bool, list[str]]:
    """(the stage's validated config, whether its vocabulary is known here, errors). Without the tokenizer (made by
    this launch's data_preparation, or on a cluster's file system) the vocabulary stands in at a size every layout
    takes, and the context says None for it."""
    from runtime.schema.training import parse_training, tokenizer_vocab

    inputs = stage_inputs(section)
    path = str(inputs.tokenizer or "")
    vocab = tokenizer_vocab(path, files="warn")[0] if path and Path(path).is_file() else None
    if vocab is None:  # the least vocabulary every layout takes: one padding multiple, divisible by tp
        model = inputs.model_without_data
        sizes = (model.get("make_vocab_size_divisible_by") or 128, model.get("tensor_model_parallel_size") or 1)
        vocab_tp = tuple(size if isinstance(size, int) and size > 0 else 1 for size in sizes)  # the schema judges
    config, report = parse_training(section, files="warn", prepared=True,
                                    vocab_size=vocab or math.lcm(*vocab_tp))
    # A config.json's vocab_size is the model's whatever the tokenizer (unpadded_vocab_size records it).
    known = vocab is not None or (config is not None and config.model.unpadded_vocab_size is not None)
    return config, known, report.errors


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

    config, vocab_known, errors = typed_config(section)
    assert config is not None, f"validated before any file is written: {errors}"
    return render_module(context(config, vocab_known=vocab_known))


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
    config, vocab_known, errors = typed_config(section)
    ctx = context(config, vocab_known=vocab_known) if config is not None and not family(config.model)[1] else None
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
