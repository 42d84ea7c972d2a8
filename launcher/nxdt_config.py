"""NxD Training YAML files as they are: `nxdt-launch training=@hf_llama3_8B_config.yaml` maps every key we
support onto our training keys (and the Neuron compiler keys onto cluster.neuron), names the keys it ignores as
warnings, and refuses the keys it cannot honour in one error. `nxdt-launch explain-config FILE` prints the mapping.

NxD Training fine-tunes and aligns from the same kind of file: with `model_alignment_strategy.dpo` or `orpo` it is
the alignment stage (`alignment=@FILE`; NxD's older DPO files keep the section under `data.alignment_strategy`), with
`model_alignment_strategy.peft` the peft stage (LoRA, `peft=@FILE`), with `model_alignment_strategy.sft` or
`model.weight_init_only` the fine_tuning stage (`fine_tuning=@FILE`); the stage a file is given as must be the one
it configures.

The result is registered as a Hydra config (<stage>=<name>) on top of the family's base recipe, so the user's own
overrides on the same command line still win and every rule of the schema runs on the result.
Pure apart from reading the file (and the config.json it points at): nothing is written.

The tables of what each NxD key becomes are launcher/nxdt_keys.py's; the handler of each key, and the Mapping a
file becomes, launcher/nxdt_mapping.py's; the base recipe and NxD's own defaults under what a file leaves out,
launcher/nxdt_base.py's. Here: reading the file, its stage, map_file's phases, a NeMo-Launcher file (through
launcher/nemo_config.py) and `expand`, which registers the result.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from launcher import config_file, nemo_config
from launcher.errors import UserError
from launcher.file_choices import is_file_choice, store_choice
from launcher.nxdt_base import file_architecture, from_base, megatron_defaults, nxd_moe_defaults, our_keys, with_base
from launcher.nxdt_keys import (ALIGNMENT_KEYS, DPO_RENAMED, IGNORED, IMPLIES, MEGATRON_BASE, MEGATRON_SWITCHES,
                                UNSUPPORTED, WEIGHTS_FROM, flatten, put)
from launcher.nxdt_mapping import FileKeys, Mapping, map_keys
from launcher.resolvers import register_resolvers
from runtime.schema.families import ARCHITECTURES
from runtime.schema.stages import TRAINER_STAGES


def load(path: str, group: str = "training") -> tuple[dict[str, Any], bool]:
    """The file, and whether it is NeMo-Launcher's. An NxD Training file is resolved on its own (its
    interpolations, e.g. ${trainer.max_steps}, refer to its own keys); a NeMo-Launcher file's refer to the launch
    config (${base_results_dir}, ${training.run.name}) and are left for it to resolve."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import yaml

    text = config_file.read(path, f"{group}=@{path}", f"an NxD Training or NeMo-Launcher {group} YAML")
    register_resolvers()
    try:
        loaded = OmegaConf.load(io.StringIO(text))
        raw = OmegaConf.to_container(loaded, resolve=False)
        if not raw:
            raise UserError(f"{group}=@{path}: the file holds no keys; give an NxD Training or NeMo-Launcher "
                            f"{group} YAML")
        if not isinstance(raw, dict):
            raise UserError(f"{group}=@{path}: holds {type(raw).__name__}, not a {group} config mapping")
        if nemo_config.is_nemo(raw):
            return raw, True
        return OmegaConf.to_container(loaded, resolve=True), False
    except yaml.MarkedYAMLError as error:  # what only composing finds, e.g. an alias to no anchor
        raise UserError(f"{group}=@{config_file.syntax_error(path, error)}") from None
    except (OmegaConfBaseException, ValueError, OSError, yaml.YAMLError) as error:
        raise UserError(f"{group}=@{path}: cannot be read as YAML ({str(error).splitlines()[0]})") from None


def nxd_stage(data: dict[str, Any]) -> tuple[str, str]:
    """The stage an NxD Training file configures, and the key that says so."""
    alignment = data.get("model_alignment_strategy") if isinstance(data.get("model_alignment_strategy"), dict) else {}
    if strategies := alignment_strategies(data):
        section, strategy = strategies[0]
        return "alignment", f"{section}.{strategy}"
    if alignment.get("peft"):
        return "peft", "model_alignment_strategy.peft (LoRA)"
    if "sft" in alignment:
        return "fine_tuning", "model_alignment_strategy.sft"
    if ((data.get("model") or {}) if isinstance(data.get("model"), dict) else {}).get("weight_init_only"):
        return "fine_tuning", "model.weight_init_only"
    return "training", ""


def alignment_strategies(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(section, strategy) for each DPO / ORPO subsection an NxD Training file holds: under model_alignment_strategy,
    or data.alignment_strategy in NxD's older DPO files."""
    found = []
    for section in ("model_alignment_strategy", "data.alignment_strategy"):
        node: Any = data
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        found += [(section, s) for s in ALIGNMENT_KEYS if isinstance(node, dict) and s in node]
    return found


def map_file(path: str, group: str | None = None) -> Mapping:
    """`group`: the stage it was given as (<group>=@FILE), which names it in errors; None: the stage it configures.
    Each key goes to its handler (launcher/nxdt_mapping.py), then what the file says as a whole is applied, then the
    base recipe is put under it."""
    data, nemo = load(path, group or "training")
    if nemo:
        return _map_nemo(path, data, group)
    stage, reason = nxd_stage(data)
    at = f"{group or stage}=@{path}"
    flat = flatten(data, {**IGNORED, **UNSUPPORTED})
    result = Mapping(Path(path), {}, {}, stage=stage, stage_reason=reason)
    weights = stage != "training" and bool((data.get("model") or {}).get("weight_init_only"))
    file = FileKeys(at, path, stage, flat, weights, result)
    map_keys(file)
    if (renamed := _dpo_renamed(flat)) is not None:
        file.error(renamed)
    _megatron(file, data)
    if result.errors or not _whole_file(file, data):
        return result
    result.training = with_base(file.training, data, stage)
    result.rows += from_base(result.training, stage)
    result.rows = _under_stage(result.rows, stage)
    ignored = [key for key, _, what in result.rows if what.startswith("ignored: ")]
    if ignored:
        file.warn(f"{len(ignored)} keys ignored, whose effect nxdt-launch has already or that tune NxD's own "
                  f"implementation ({', '.join(ignored[:3])}, ...); `nxdt-launch explain-config {path}` lists each "
                  f"with the reason")
    return result


def _megatron(file: FileKeys, data: dict[str, Any]) -> None:
    """A megatron file's architecture, named by its four switches, and NxD's values for the keys it leaves out."""
    megatron = data.get("model_source") == "megatron"
    if megatron or any(key in file.flat for key in MEGATRON_SWITCHES):
        architecture, row = file_architecture(file.flat)
        if architecture is None:
            file.error(row[2])
        else:
            put(file.training, "model.architecture", architecture)
        file.result.rows.append(row)
    if megatron:
        file.result.rows += megatron_defaults(file.flat, file.training)


def _whole_file(file: FileKeys, data: dict[str, Any]) -> bool:
    """What the file says as a whole once its keys are mapped: the values IMPLIES sets, NxD's MoE defaults, where its
    data and starting weights come from, LoRA, and the alignment strategy. False: two strategies, nothing more to
    map."""
    flat, training, stage = file.flat, file.training, file.stage
    for key, (trigger, target, implied, _) in IMPLIES.items():
        if flat.get(key, object()) == trigger:
            put(training, target[len("training."):], implied)
    file.result.rows += nxd_moe_defaults(training)
    if stage == "training" and data.get("model_source") == "hf" and (data.get("data") or {}).get("train_dir"):
        file.warn("data.train_dir: NxD Training's hf configs point it at a Hugging Face datasets directory; "
                  "nxdt-launch trains on Megatron indexed data: prepare it with stages=[data_preparation] and point "
                  "training.model.data.data_prefix at the result")
    if file.weights and flat.get(WEIGHTS_FROM) is None:
        file.error(f"model.weight_init_only: True without {WEIGHTS_FROM}: there are no weights to start from; set "
                   f"{WEIGHTS_FROM} to a Hugging Face model directory")
    elif file.weights:
        file.warn(f"{WEIGHTS_FROM}: {flat[WEIGHTS_FROM]} becomes {stage}.model.restore_from_path, which reads a "
                  f"Hugging Face model directory or an nxdt-launch checkpoint, not NxD Training's own checkpoint "
                  f"format: point it at the Hugging Face model NxD's checkpoint was converted from")
    if stage == "peft" or (stage == "alignment" and isinstance(data.get("model_alignment_strategy"), dict)
                           and data["model_alignment_strategy"].get("peft")):  # DPO / ORPO with LoRA
        put(training, "model.peft.peft_scheme", "lora")
        file.row("(implied) model_alignment_strategy.peft", "lora", "training.model.peft.peft_scheme = 'lora'")
    if stage == "alignment":
        strategies = sorted({strategy for _, strategy in alignment_strategies(data)})
        if len(strategies) > 1:
            file.error(f"model_alignment_strategy: both {' and '.join(strategies)} are set; an alignment run has "
                       f"one strategy: keep one section")
            return False
        training["strategy"] = strategies[0]
        file.row(f"(implied) {file.result.stage_reason}", strategies[0], f"training.strategy = {strategies[0]!r}")
    return True


def _dpo_renamed(flat: dict[str, Any]) -> str | None:
    """DPO's prompt limit under both its names, with two values: which one is meant is the user's to say."""
    for section in ("model_alignment_strategy", "data.alignment_strategy"):
        new, old = (flat.get(f"{section}.dpo.{name}") for name in DPO_RENAMED)
        if new is not None and old is not None and new != old:
            return (f"{section}.dpo: max_prompt_length ({new}) and its older name max_dpo_prompt_length ({old}) "
                    f"disagree; keep one")
    return None


def _under_stage(rows: list[tuple[str, Any, str]], stage: str) -> list[tuple[str, Any, str]]:
    """Rows name our keys under `training.`; a fine-tuning file's are its stage's."""
    if stage == "training":
        return rows
    return [(key, value, re.sub(r"(^|with \S+: )training\.", rf"\g<1>{stage}.", what)) for key, value, what in rows]


def _map_nemo(path: str, data: dict[str, Any], group: str | None = None) -> Mapping:
    stage, reason = nemo_config.nemo_stage(data)
    at = f"{group or stage}=@{path}"
    result = Mapping(Path(path), {}, {}, dialect="NeMo-Launcher", stage=stage, stage_reason=reason)
    training: dict[str, Any] = {}
    ignored: list[str] = []

    def error(key: str, why: str) -> None:
        result.errors.append(f"{at}: {key} {why}")
        result.rows.append((key, flat[key], "refused: " + why))

    flat = flatten(data, set(nemo_config.IGNORED))
    nemo_config.map_keys(
        flat, our_keys(), put=lambda key, value: put(training, key, value),
        row=lambda key, value, what: result.rows.append((key, value, what)), error=error,
        warn_key=ignored.append)
    if result.errors:
        return result
    # NeMo's checkpoint callback saves at every validation: every val_check_interval steps.
    every = "exp_manager.checkpoint_callback_params.every_n_train_steps"
    if every not in flat and isinstance(flat.get("trainer.val_check_interval"), int):
        put(training, every, flat["trainer.val_check_interval"])
        result.rows.append((every, None, f"training.{every} = trainer.val_check_interval (NeMo saves at validation)"))
    family = ARCHITECTURES.get(training.get("model", {}).get("architecture"), MEGATRON_BASE).tiny_recipe
    if stage != "training":  # the fine-tuning base, without its demo data and weights
        family, model = "llama/tiny", training.setdefault("model", {})
        model.setdefault("restore_from_path", None)
        for split in ("train_ds", "validation_ds"):
            model.setdefault("data", {}).setdefault(split, {}).setdefault("file_names", [])
    result.training = {"defaults": [f"/{stage}/{family}@_here_", "_self_"], **training}
    result.rows = _under_stage(result.rows, stage)
    if ignored:
        result.warnings.append(f"{at}: {len(ignored)} NeMo keys ignored, whose effect nxdt-launch has "
                               f"already or that only tune NeMo's own implementation ({', '.join(ignored[:3])}, "
                               f"...); `nxdt-launch explain-config {path}` lists each with the reason")
    return result


def cluster_overrides(mapping: Mapping) -> list[str]:
    """cluster.neuron.* as Hydra overrides (`++`: the key may be new on a non-Neuron cluster group)."""
    if not mapping.cluster:
        return []
    return [f"++cluster.{key}={_hydra_value(value)}" for key, value in flatten(mapping.cluster).items()]


def _hydra_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if not isinstance(value, str):
        return str(value)
    if "'" not in value:
        return f"'{value}'"  # inside quotes only a quote (and the backslashes before one) needs escaping
    if '"' not in value:
        return f'"{value}"'
    return "'" + value.replace("'", "\\'") + "'"


# The groups a file may be given to: the stages whose config is a training config.
FILE_GROUPS = TRAINER_STAGES


def expand(overrides: list[str]) -> tuple[list[str], list[str]]:
    """`training=@FILE` (`fine_tuning=@FILE`, `peft=@FILE`, `alignment=@FILE`) -> `<group>=<registered name>` plus
    the file's cluster overrides, placed where it stood so that later overrides win. A fine-tuning or alignment file
    also names the run, as a training file does through training.run.name, unless run_name is given. Returns
    (overrides, warnings); a file with refused keys, or given as another stage than the one it configures, is a
    UserError."""
    out, warnings = [], []
    named = any(o.partition("=")[0].lstrip("+") == "run_name" for o in overrides)
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+")
        if group not in FILE_GROUPS or not sep or not is_file_choice(value):
            out.append(override)
            continue
        mapping = map_file(value[1:], group)
        if mapping.stage != group:  # first: the file's other mistakes are named by the right stage then
            verb = "aligns" if mapping.stage == "alignment" else "fine-tunes"
            what = f"it {verb} ({mapping.stage_reason})" if mapping.stage_reason else "it pretrains"
            raise UserError(f"{group}=@{value[1:]}: {what}, so it runs as the {mapping.stage} stage: launch it with "
                            f"stages=[{mapping.stage}] {mapping.stage}=@{value[1:]}")
        if mapping.errors:
            raise UserError(*mapping.errors)
        store_choice(group, mapping.name, mapping.training)
        out += [f"{group}={mapping.name}", *cluster_overrides(mapping)]
        if group != "training" and not named:
            out.append(f"run_name=${{{group}.run.name}}")
        warnings += mapping.warnings
    return out, warnings
