"""The Hugging Face config.json and weights a training's model starts from: which config.json decides the model
(model.model_config or model.restore_from_path), what model.model_config_overrides may set over it, the YAML keys
that contradict it, and the starting weights checked against the model keys."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.schema import rules
from runtime.schema.model import hf_model_keys, read_hf_config
from runtime.schema.reader import Report, Section, closest
from runtime.schema.safetensors_file import hf_weights_problems, tensor_shapes
from runtime.schema.training_files import Files, is_remote

# Keys a config.json yields that the YAML may set otherwise: the training's sequence length (config.json's
# max_position_embeddings is only its default) and the vocabulary padding (checked against config.json's size).
_YAML_DECIDES = ("encoder_seq_length", "make_vocab_size_divisible_by")
# model.moe keys that shape training, not the network: token dropping, the auxiliary losses' weights and the
# selection bias's balancing rate.
_TRAINING_CHOICES = ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate")


# What model.model_config_overrides may set over config.json: the keys NxD Training's Hugging Face models apply from
# their YAML (model.num_layers, hidden_size, rope_theta; e.g. hf_llama_7B_config's 4-layer cut of Llama 2 7B).
CONFIG_OVERRIDES = {"num_layers": "int", "hidden_size": "int", "rotary_base": "float"}


def config_overrides(model: Section, hf_keys: dict, source: str | None, report: Report) -> dict[str, Any]:
    """model.model_config_overrides, typed: keys that win over config.json's (an NxD Training file's explicit model
    keys, launcher/nxdt_config.py), each named in a warning where it changes config.json's value. Elsewhere a YAML
    key that contradicts config.json is refused (disagreements)."""
    overrides = model.mapping("model_config_overrides") or {}
    key = model.key("model_config_overrides")
    if overrides and source is None:
        report.error(f"{key}: there is no config.json to override (model.model_config is not set); set the model's "
                     f"keys themselves (model.{next(iter(overrides))})")
        return {}
    typed: dict[str, Any] = {}
    section = Section(overrides, key, report)
    for name in overrides:
        if name not in CONFIG_OVERRIDES:
            report.error(f"{key}.{name}: not a key that can be set over config.json; "
                         f"{closest(str(name), list(CONFIG_OVERRIDES))}valid keys here: {', '.join(CONFIG_OVERRIDES)}")
            continue
        value = (section.int(name, minimum=1) if CONFIG_OVERRIDES[name] == "int"
                 else section.float(name, above=0.0))
        if value is None:
            continue
        typed[name] = value
        if name in hf_keys and hf_keys[name] != value:
            report.warn(f"{key}.{name}: {value} replaces config.json's {hf_keys[name]} ({source}), as NxD Training "
                        f"applies its YAML's model keys over config.json")
    return typed


def model_config_source(model: Section) -> tuple[str | None, str]:
    """(the config.json that decides the model, the key that names it): model.model_config, else the config.json of
    a local Hugging Face directory in model.restore_from_path (a checkpoint of ours has none), else None."""
    model_config = model.raw("model_config", None)
    if model_config is not None:
        return str(model_config), "model_config"
    restore = model.raw("restore_from_path", None)
    if not isinstance(restore, str) or (Path(restore).is_dir() and not (Path(restore) / "config.json").exists()):
        return None, "model_config"  # no starting weights, or a checkpoint of ours: the YAML holds the shape
    # A Hugging Face directory, or a path that cannot be looked at here (remote, or not yet there in a dry run:
    # then only what the YAML holds is checked, and the rest at launch).
    return f"{restore.rstrip('/')}/config.json", "restore_from_path"


def disagreements(model: Section, hf_keys: dict, source: str | None, source_key: str) -> str | None:
    """One line naming every YAML key that says otherwise than config.json, with both values; None if none."""
    found: list[tuple[str, Any, Any]] = []
    for key, value in hf_keys.items():
        if key in _YAML_DECIDES or not model.has(key):
            continue
        found += _differing(key, model.data[key], value)
    if not found:
        return None
    pairs = ", ".join(f"{key} {mine!r} (config.json: {theirs!r})" for key, mine, theirs in found)
    first = model.key(found[0][0])
    keys = "the key" if len(found) == 1 else "those keys"
    more = ", ..." if len(found) > 1 else ""
    return (f"{first}: the YAML disagrees with {source} (model.{source_key}), which decides the model: {pairs}; "
            f"drop {keys} ({first}=null{more}) or use weights whose config.json says so")


def _differing(key: str, mine: Any, theirs: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(theirs, dict) and isinstance(mine, dict):  # model.moe / model.rope_scaling, key by key
        return [pair for name, value in theirs.items()
                if name not in _TRAINING_CHOICES and mine.get(name) is not None
                for pair in _differing(f"{key}.{name}", mine[name], value)]
    try:
        same = mine == theirs or (isinstance(theirs, float) and float(mine) == theirs)
    except (TypeError, ValueError):
        same = False
    return [] if same else [(key, mine, theirs)]


_RESTORE_SHAPE = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups")


def read_restore_from(model: Section, shape: dict, files: Files, p: str) -> str | None:
    """model.restore_from_path: the weights fine-tuning starts from (NeMo's key; NxD Training's is
    exp_manager.resume_from_checkpoint with model.weight_init_only). A Hugging Face directory is checked against
    the model keys here, before anything is submitted; a checkpoint of ours when it is loaded."""
    path = model.str("restore_from_path", None)
    if path is None or not files.inputs_checked or is_remote(path):
        return path
    key = model.key("restore_from_path")
    directory = Path(path)
    if not directory.exists():
        files.problem(f"{key}: {path} does not exist; point it at a Hugging Face model directory or a checkpoint")
        return path
    if not (directory / "config.json").is_file():
        return path  # a checkpoint of ours (runtime/finetune.py reads and checks it)
    # Headers only: a truncated download fails here, not in every worker after the queue wait.
    problems = hf_weights_problems(directory)
    for problem in problems:
        model.report.error(f"{key}: {problem}; re-download it, or point {key} at a complete copy")
    if not problems and shape.get("unpadded_vocab_size") is not None:  # the rows a launch loads and pads
        model.report.error(rules.weights_vocab(tensor_shapes(directory), shape["unpadded_vocab_size"], key,
                                               str(model_config_source(model)[0])))
    if model_config_source(model)[1] == "restore_from_path":
        return path  # its config.json decided the model keys (model_shape), and named what it could not read
    try:
        theirs = hf_model_keys(read_hf_config(str(directory / "config.json")))
    except (ValueError, TypeError, KeyError) as error:
        model.report.error(f"{key}: {directory / 'config.json'}: {error}")
        return path
    for name in _RESTORE_SHAPE:
        mine = shape.get(name) if name != "num_query_groups" else shape.get(name) or shape.get("num_attention_heads")
        other = theirs.get(name) if name != "num_query_groups" else theirs.get(name) or theirs.get(
            "num_attention_heads")
        if mine is not None and other is not None and mine != other:
            model.report.error(f"{key}: {path} holds a model with {name} {other} but model.{name} is {mine} (from "
                               f"model.model_config); drop model.model_config so that the weights' own config.json "
                               f"decides, or choose weights of this model")
            break
    return path
