"""The recipe tests compose some 140 launches through Hydra (every recipe on its own cluster, every recipe on every
target), and Hydra reads, parses and wraps every file of a launch's defaults chain again for each one: its
CachingConfigRepository lasts one compose. While a test of this directory runs, a config file is loaded once while
its mtime and size stay, and each compose gets a deep copy of what Hydra would have loaded (Hydra merges loaded
nodes into its result in place). Every compose, rule and check runs as before, in about two thirds of the CPU time.
Nothing here writes a config file; the other test directories, some of which do, load them as a user's launch does."""

import copy
import os

import pytest

_loaded: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def _hydra_loads_each_config_file_once(monkeypatch):
    try:
        from hydra._internal.config_repository import ConfigRepository
    except ImportError:  # another Hydra: compose as it does, only slower
        return
    load = ConfigRepository.load_config

    def load_config(self, config_path: str):
        key = _key(self, config_path)
        if key is None:
            return load(self, config_path)
        if key not in _loaded:
            _loaded[key] = load(self, config_path)  # a load that raises keeps nothing
        return copy.deepcopy(_loaded[key])

    monkeypatch.setattr(ConfigRepository, "load_config", load_config)


def _key(repo, config_path: str) -> tuple | None:
    """What loading `config_path` depends on: the source that holds it (the first that has it, as Hydra looks), and
    for a file its mtime and size. None for any other source: Hydra's ConfigStore, which a launch can add choices to
    (training=@FILE). By scheme, not class: Hydra's plugin scan loads its source modules a second time."""
    source = next((s for s in repo.get_sources() if s.is_config(config_path)), None)
    if source is None or source.scheme() not in ("file", "pkg"):
        return None
    if source.scheme() == "pkg":  # Hydra's own configs, in its installed package
        return "pkg", source.path, config_path
    name = config_path if config_path.endswith(".yaml") else f"{config_path}.yaml"
    stat = os.stat(os.path.realpath(os.path.join(source.path, name)))
    return "file", source.path, config_path, stat.st_mtime_ns, stat.st_size
