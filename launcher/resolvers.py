"""The OmegaConf resolvers NeMo-Launcher's configs use (${multiply:...}, ${cwd:}, ...), registered before any
config is loaded: by compose.py for the launch config, by nxdt_config.py for a training file given as @FILE.
A module of its own so that neither of those has to import the other."""

from __future__ import annotations

import math
import os


def _divide_ceil(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    resolvers = {
        "multiply": lambda *xs: math.prod(xs),
        "divide_ceil": _divide_ceil,
        "divide_floor": lambda a, b: int(a) // int(b),
        "cwd": os.getcwd,
    }
    for name, fn in resolvers.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)
