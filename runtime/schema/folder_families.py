# The lookup of the folder families (runtime/families/<name>/, listed in runtime/families/__init__.py) by name, as
# plugins are found: a family imports the shared layers it is built from (runtime/schema, runtime/models,
# runtime/convert), so no shared layer imports a family (tests/test_import_contracts.py); each asks here instead.
# Standard library only.
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_REGISTRY = "runtime.families"


def folders() -> tuple[str, ...]:
    """The folder families' names, each its `model.architecture`, in the order the choices are listed."""
    return importlib.import_module(_REGISTRY).FOLDERS


def export_order() -> tuple[str, ...]:
    """The same names in the order their Hugging Face families are tried for an export."""
    return importlib.import_module(_REGISTRY).EXPORT_ORDER


def folder_family(architecture: Any) -> ModuleType | None:
    """The folder family whose `model.architecture` this is (its standard-library __init__), or None."""
    return importlib.import_module(f"{_REGISTRY}.{architecture}") if architecture in folders() else None


def folder_family_modules() -> tuple[ModuleType, ...]:
    return tuple(folder_family(name) for name in folders())


def hf_families(family: ModuleType) -> tuple[ModuleType, ...]:
    """The Hugging Face families a folder family's network is (each a module of the same protocol): its VARIANTS,
    then its own."""
    return (*getattr(family, "VARIANTS", ()), family)
