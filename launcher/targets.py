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
every stage afterwards, so the runtime never sees it."""

from __future__ import annotations

from launcher.errors import UserError
from launcher.neuron import DEFAULTS as NEURON_DEFAULTS
from launcher.neuron import HARDWARE as NEURON_HARDWARE
from launcher.stages import TRAINER_STAGES

TARGETS = ("trn1", "trn2", "gpu")   # the keys of a recipe's `targets`


def cluster_target(cfg) -> str | None:
    """trn1 | trn2 from cluster.neuron.hardware (None when that names no known hardware: neuron.py reports it),
    gpu for a cluster without a `neuron` section."""
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "cluster.neuron", default=None) is None:
        return "gpu"
    name = OmegaConf.select(cfg, "cluster.neuron.hardware", default=None) or NEURON_DEFAULTS["hardware"]
    return name if name in NEURON_HARDWARE else None


def apply(cfg) -> str | None:
    """The recipe that is the training recipe's layout for the cluster's target, when it names one (compose.py
    composes that instead); None to keep this config. Removes `targets` from every trainer stage either way (the
    fine-tuning recipes that start from a training recipe inherit its, but have their own variants)."""
    from omegaconf import OmegaConf, open_dict

    target = cluster_target(cfg)
    chosen = None
    for stage in TRAINER_STAGES:
        node = cfg.get(stage)
        if node is None or not OmegaConf.is_dict(node) or "targets" not in node:
            continue
        layouts = node.get("targets")
        if stage == "training" and layouts is not None:
            chosen = layouts.get(target) if target else None
            if chosen is not None and not isinstance(chosen, str):
                raise UserError(f"training.targets.{target}: {chosen!r} must name a training recipe that holds the "
                                f"{target} layout, e.g. gpt3/175b_{target}")
        with open_dict(node):
            node.pop("targets")
    select_validation_hardware(cfg, target)
    return chosen


def select_validation_hardware(cfg, target: str | None) -> None:
    """cluster-validate's `auto` accelerator and devices: a Neuron cluster's NeuronCores, else one CPU worker."""
    node = cfg.get("cluster_validation")
    if node is None:
        return
    neuron = target in NEURON_HARDWARE
    if node.get("accelerator") == "auto":
        node.accelerator = "neuron" if neuron else "cpu"
    if node.get("devices") == "auto":
        node.devices = NEURON_HARDWARE[target].workers_per_node if neuron else 1
