# The model families that live in one folder each (docs/runtime.md, "Adding a model family"): runtime/families/<name>/
# holds everything that knows the family, and <name> is its `model.architecture`. The folder's own __init__.py is
# standard library only (the launcher imports it without torch): the config.json <-> `model:` keys protocol of
# runtime/schema/families (MODEL_TYPES, TIED_DEFAULT, model_keys, exports, refusal, hf_config) plus SWITCHES, the
# ModelConfig keys it computes, and GATED_MLP. Its torch parts are submodules, imported when asked for:
#   model.py    MODEL, the network (a CausalLM composed from runtime/models/layers.py)
#   weights.py  rules(cfg, Rule): our tensors <-> Hugging Face tensors, both ways (runtime/convert/hf.py)
# Shared code asks this registry, never `architecture == "<name>"`. Standard library only.
from __future__ import annotations

import importlib
from types import ModuleType

# One line per folder family: adding one is a folder and its name here.
FOLDERS: tuple[str, ...] = ("gemma3",)


def folder_family(architecture: str | None) -> ModuleType | None:
    """The folder family whose `model.architecture` this is (its torch-free __init__), or None."""
    return importlib.import_module(f"{__name__}.{architecture}") if architecture in FOLDERS else None


def folder_families() -> tuple[ModuleType, ...]:
    return tuple(folder_family(name) for name in FOLDERS)


def family_part(architecture: str | None, part: str) -> ModuleType | None:
    """A folder family's torch part (`model`, `weights`), or None for an architecture without a folder."""
    return importlib.import_module(f"{__name__}.{architecture}.{part}") if architecture in FOLDERS else None


def family_trait(architecture: str | None, name: str, default):
    """A constant a folder family declares (SWITCHES, GATED_MLP, ...), else `default`."""
    family = folder_family(architecture)
    return getattr(family, name, default) if family is not None else default
