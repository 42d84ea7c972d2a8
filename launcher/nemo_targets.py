"""The Trainium layouts a NeMo-Launcher training file gets: the recipe of ours that trains the file's model names
its layouts on trn1 and trn2, and the file is registered once with each (launcher/nemo_config.py's map_keys asks).
"""

from __future__ import annotations

import hashlib
from typing import Any

from launcher.nemo_keys import SWITCHES
from runtime.schema.families import ARCHITECTURES, megatron_architecture

# The keys of a Trainium layout: where the file's model runs, not what it computes.
LAYOUT = ("trainer.num_nodes", "trainer.devices", "trainer.accelerator", "model.micro_batch_size",
          "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
          "model.virtual_pipeline_model_parallel_size", "model.context_parallel_size",
          "model.expert_model_parallel_size", "model.sequence_parallel", "model.zero1",
          "model.activations_checkpoint_granularity", "model.activations_checkpoint_recompute")
# What makes two models the same model (the recipe's and the file's).
SHAPE = ("model.architecture", "model.num_layers", "model.hidden_size", "model.num_attention_heads",
         "model.encoder_seq_length", "model.moe.num_experts", "model.moe.dropless")


def trainium_targets(flat, mapped: dict[str, Any], put, row) -> None:
    """`targets` naming, for trn1 and trn2, the file with the layout our recipe for its model uses there (registered
    as Hydra configs, as launcher/nxdt_config.py registers the file): launcher/targets.py picks one by the cluster."""
    recipe = _recipe_for(mapped)
    if recipe is None:
        return
    name, layouts = recipe
    family = ARCHITECTURES.get(mapped.get("model.architecture"),
                               ARCHITECTURES[megatron_architecture(tuple(SWITCHES.values()))]).tiny_recipe
    every = "exp_manager.checkpoint_callback_params.every_n_train_steps"
    file = dict(mapped)
    if every not in flat and isinstance(flat.get("trainer.val_check_interval"), int):
        file[every] = flat["trainer.val_check_interval"]  # as nxdt_config._map_nemo adds it
    targets: dict[str, Any] = {"gpu": None}
    for target, layout_recipe in layouts.items():
        layout = _merged(layout_recipe)
        variant = {**file, **{key: layout.get(key) for key in LAYOUT}, "targets": None}
        digest = hashlib.sha256(repr(sorted(variant.items())).encode()).hexdigest()[:10]
        targets[target] = f"_nemo_{target}_{digest}"
        _register(targets[target], family, variant)
        row(f"(implied) targets.{target}", layout_recipe,
            f"on {target}: the layout of training={layout_recipe} ({', '.join(LAYOUT)}), this file's model "
            f"being training={name}'s")
    put("targets", targets)


def _recipe_for(mapped: dict[str, Any]) -> tuple[str, dict[str, str]] | None:
    """(our recipe with the file's model, {trn1|trn2: the recipe holding its layout there}), or None."""
    from launcher.paths import conf_dir
    from launcher.targets import targets_of_file

    want = _shape(mapped)
    for path in sorted((conf_dir() / "training").glob("*/*.yaml")):
        name = f"{path.parent.name}/{path.stem}"
        own, targets = targets_of_file(name)
        if not own or not isinstance(targets, dict) or _shape(_merged(name)) != want:
            continue
        layouts = {t: targets.get(t) or name for t in ("trn1", "trn2") if t in targets}
        return name, layouts
    return None


def _shape(flat: dict[str, Any]) -> tuple:
    shape = {key: flat.get(key) for key in SHAPE}
    shape["rope scaled"] = flat.get("model.rope_scaling") is not None or \
        any(key.startswith("model.rope_scaling.") for key in flat)  # a recipe's, dotted
    if shape["model.moe.num_experts"] is None:
        shape["model.moe.dropless"] = None
    return tuple(shape.items())


def _merged(recipe: str) -> dict[str, Any]:
    """A training recipe's keys, dotted, as Hydra merges its file chain (conf/training only)."""
    from launcher.targets import _file_chain

    merged: dict[str, Any] = {}
    for text in reversed(_file_chain("training", recipe)):
        merged.update(_dotted({k: v for k, v in text.items() if k != "defaults"}))
    return merged


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _register(name: str, family: str, dotted: dict[str, Any]) -> None:
    from launcher.file_choices import store_choice

    node: dict[str, Any] = {"defaults": [f"/training/{family}@_here_", "_self_"]}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        tree = node
        for part in parents:
            tree = tree.setdefault(part, {})
        tree[leaf] = value
    store_choice("training", name, node)
