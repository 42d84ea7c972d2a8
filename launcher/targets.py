"""The cluster decides the hardware; the recipe names its layout for each kind of it.

A training recipe is written for one target (its body: NeMo-Launcher's GPU layout for GPT-3, NxD Training's trn1
layout for Llama) and names the recipes that hold its layouts for the others:

    targets: {trn1: gpt3/175b_trn1, trn2: gpt3/175b_trn2}     # in gpt3/175b, written for GPUs

The cluster names the target: `cluster.neuron.hardware` (trn1 on pcluster_trn1 and trn1n, trn2 on pcluster_trn2),
else `gpu`. `training=gpt3/175b cluster=pcluster_trn1` then composes gpt3/175b_trn1 in its place, with every
override the user typed (an explicit override always wins), and every rule runs on the result: launcher/neuron.py
refuses a non-Neuron accelerator or the wrong worker count on a Neuron cluster, launcher/validate.py a layout that
does not fit the device's memory. A target's recipe sets `targets: null`: it is pinned to its own layout, as is
every recipe without `targets` (the tiny CPU ones), and choosing it by name keeps it on any cluster.

cluster-validate takes `accelerator: auto` and `devices: auto` from the same cluster setting.

Applied to the composed config before anything resolves or reads it (launcher/compose.py); `targets` is gone from
every stage afterwards, so the runtime never sees it. compose.py first composes the recipe that `guess` reads from
conf/'s files (the recipe's `targets` and the cluster's hardware), and keeps the result when the composed config
names the same target: a Hydra compose costs most of a dry run, and this saves the one that would only be replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from launcher.errors import UserError
from launcher.paths import conf_dir
from launcher.neuron import DEFAULTS as NEURON_DEFAULTS
from launcher.neuron import HARDWARE as NEURON_HARDWARE
from launcher.stages import TRAINER_STAGES

TARGETS = ("trn1", "trn2", "gpu")   # the keys of a recipe's `targets`


def _select(cfg, key: str):
    """The value at a dotted key, None where there is none: OmegaConf.select on a composed DictConfig, a walk
    through the mappings of a plain one (launcher/plain_compose.py, which leaves a config with interpolations
    there to Hydra)."""
    if isinstance(cfg, dict):
        for part in key.split("."):
            if not isinstance(cfg, dict) or part not in cfg:
                return None
            cfg = cfg[part]
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def _pop(node, key: str) -> None:
    if isinstance(node, dict):
        node.pop(key)
        return
    from omegaconf import open_dict

    with open_dict(node):
        node.pop(key)


def cluster_target(cfg) -> str | None:
    """trn1 | trn2 from cluster.neuron.hardware (None when that names no known hardware: neuron.py reports it),
    gpu for a cluster without a `neuron` section."""
    if _select(cfg, "cluster.neuron") is None:
        return "gpu"
    name = _select(cfg, "cluster.neuron.hardware") or NEURON_DEFAULTS["hardware"]
    return name if name in NEURON_HARDWARE else None


def apply(cfg) -> str | None:
    """The recipe that is the training recipe's layout for the cluster's target, when it names one (compose.py
    composes that instead); None to keep this config. Removes `targets` from every trainer stage either way (the
    fine-tuning recipes that start from a training recipe inherit its, but have their own variants). `cfg`: a
    composed DictConfig or a plain one."""
    target = cluster_target(cfg)
    chosen = None
    for stage in TRAINER_STAGES:
        node = cfg.get(stage)
        if node is None or not isinstance(node, Mapping) or "targets" not in node:
            continue
        layouts = node.get("targets")
        if stage == "training" and layouts is not None:
            chosen = layouts.get(target) if target else None
            if chosen is not None and not isinstance(chosen, str):
                raise UserError(f"training.targets.{target}: {chosen!r} must name a training recipe that holds the "
                                f"{target} layout, e.g. gpt3/175b_{target}")
        _pop(node, "targets")
    select_validation_hardware(cfg, target)
    return chosen


def select_validation_hardware(cfg, target: str | None) -> None:
    """cluster-validate's `auto` accelerator and devices: a Neuron cluster's NeuronCores, else one CPU worker."""
    node = cfg.get("cluster_validation")
    if node is None:
        return
    neuron = target in NEURON_HARDWARE
    if node.get("accelerator") == "auto":
        node["accelerator"] = "neuron" if neuron else "cpu"
    if node.get("devices") == "auto":
        node["devices"] = NEURON_HARDWARE[target].workers_per_node if neuron else 1


# --- choosing the target's recipe from conf/'s files, before composing -----------------------------------------

_parsed: dict[Path, tuple[tuple[int, int], dict]] = {}


def _yaml(path: Path) -> dict:
    """A conf file's YAML, parsed once per process while its mtime and size stay (compose guesses on every call;
    libyaml's parser where PyYAML has it)."""
    import yaml

    stat = path.stat()
    key = (stat.st_mtime_ns, stat.st_size)
    if (kept := _parsed.get(path)) is None or kept[0] != key:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        kept = _parsed[path] = key, (yaml.load(path.read_text(), Loader=loader) or {})
    return kept[1]


def _file_chain(group: str, name: str) -> list[dict]:
    """The YAML of a group's config file and of the files its defaults list names in the same group, nearest
    first: what Hydra merges (a file's own keys win over the ones it inherits, `_self_` last as here). [] when
    a file is missing (a choice registered in this process, a typo compose reports)."""
    chain, seen = [], set()
    while name and name not in seen:
        seen.add(name)
        path = conf_dir() / group / f"{name}.yaml"
        if not path.is_file():
            return []
        text = _yaml(path)
        chain.append(text)
        parents = [d for d in text.get("defaults") or [] if isinstance(d, str) and d != "_self_"]
        parent = parents[0] if parents else ""
        name = parent.removeprefix(f"/{group}/").split("@")[0] if parent.startswith(f"/{group}/") else \
            (parent if parent and "/" not in parent and ":" not in parent else "")
    return chain


def targets_of_file(recipe: str) -> tuple[bool, dict | None]:
    """(set in the recipe's own file, the `targets` mapping it composes with): read along its Hydra defaults
    chain, as Hydra merges it (the nearest file that sets `targets` decides; null pins a target's own layout)."""
    for depth, text in enumerate(_file_chain("training", recipe)):
        if "targets" in text:
            return depth == 0, text["targets"]
    return False, None


def _default_choice(group: str) -> str | None:
    """The root config's choice for a group (conf/config.yaml's defaults list)."""
    defaults = _yaml(conf_dir() / "config.yaml").get("defaults") or []
    return next((entry[group] for entry in defaults if isinstance(entry, dict) and group in entry), None)


def _cluster_target_of_file(cluster: str) -> str | None:
    """cluster_target, read from the cluster's files: the nearest `neuron` decides whether there is one, the
    nearest `neuron.hardware` which."""
    sections = [text["neuron"] for text in _file_chain("cluster", cluster) if "neuron" in text]
    if not sections or sections[0] is None:
        return "gpu"
    name = next((s["hardware"] for s in sections if isinstance(s, dict) and "hardware" in s), None)
    name = name or NEURON_DEFAULTS["hardware"]
    return name if name in NEURON_HARDWARE else None


def guess(overrides: list[str]) -> tuple[str, str] | None:
    """(the target, the recipe that holds the training recipe's layout for it), as `apply` would choose them,
    read from conf/'s files without composing; None where the overrides could change what the files say (the
    recipe's `targets`, Hydra's search path) or the recipe names no layout for the cluster's target. A guess is
    kept only when the composed config names the same target (compose.py): overrides of the cluster's hardware
    or interpolations the files do not show are caught there."""
    choices: dict[str, list[str]] = {"training": [], "cluster": []}
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        if key.startswith(("training.targets", "hydra")) or key == "targets":
            return None
        if key in choices:
            choices[key].append(value)
    if len(choices["training"]) > 1 or len(choices["cluster"]) > 1:
        return None
    recipe = (choices["training"] or [_default_choice("training")])[0]
    cluster = (choices["cluster"] or [_default_choice("cluster")])[0]
    if not all(isinstance(c, str) and c and ".." not in c and not c.startswith(("/", "@")) for c in (recipe, cluster)):
        return None
    import yaml

    try:
        mapping = targets_of_file(recipe)[1]
        target = _cluster_target_of_file(cluster) if isinstance(mapping, dict) else None
    except (OSError, yaml.YAMLError, AttributeError, TypeError):  # compose reports what is wrong with the files
        return None
    chosen = mapping.get(target) if target else None
    return (target, chosen) if isinstance(chosen, str) else None
