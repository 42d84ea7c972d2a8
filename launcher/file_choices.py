"""Where the configs an NxD Training or NeMo file maps to (launcher/nxdt_config.py, launcher/nemo_config.py) go as
choices of their config group: to the compose that asked for them. Inside `collecting()` (the plain composer's
compose, launcher/cache.py) they are kept in a dict it reads; otherwise they go to Hydra's ConfigStore, where
launcher/compose.py keeps them for its one compose."""
from __future__ import annotations

import contextlib


def is_file_choice(value: str) -> bool:
    """Whether an override's value names a file given as a choice (`training=@FILE`)."""
    return value.startswith("@")


def names_a_file(overrides: list[str]) -> bool:
    """Whether an override's value may be a file given as a choice (`training=@FILE`): then launcher/nxdt_config.py
    maps it (nxdt_config.expand) before anything is composed."""
    return any(is_file_choice(o.partition("=")[2]) for o in overrides)


# Where store_choice puts a file's choices while a compose without Hydra reads them (collecting); none: Hydra's
# ConfigStore, where compose.py keeps them to the compose that asked.
_COLLECTING: list[dict[str, dict]] = []


def store_choice(group: str, name: str, node: dict) -> None:
    """A file's config as the choice `group=name` of the compose under way: into the innermost collecting() (the
    plain composer reads it from there, launcher/cache.py), else into Hydra's ConfigStore."""
    if _COLLECTING:
        _COLLECTING[-1][f"{group}/{name}"] = node
        return
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=group, name=name, node=node)


@contextlib.contextmanager
def collecting():
    """The choices store_choice is given inside this block, as {"group/name": node}, instead of Hydra's."""
    stored: dict[str, dict] = {}
    _COLLECTING.append(stored)
    try:
        yield stored
    finally:
        _COLLECTING.pop()
