"""The locations of a launch's files as placeholders, for the launch cache (launcher/cache.py): base_results_dir,
run_name and each stage's run.name name where a launch writes, not what it runs, so that one cache entry serves
every results directory and run name.

A launch that gives them as plain words or paths (split_locations) is composed without them; `place` sets each
of them to a placeholder of its own before the config is resolved, and notes each one's own value in terms of the
others' placeholders (run_name is the training run's name); `fill` puts a launch's values, as given or as noted,
where the placeholders are. A value reaches the rest of the config only by interpolation, as text, and what does
not (a resolver handed one as an argument, an environment variable named by one, one in a mapping's key:
`resolve_placed`) makes the launch keyed on every override as typed."""

from __future__ import annotations

import re
from typing import Any

from launcher.paths import CONFIG_GROUPS

# The keys that say where a launch's files go; besides these, each stage's `run.name` (LOCATIONS_UNDER).
LOCATIONS = ("base_results_dir", "run_name")
LOCATIONS_UNDER = "run.name"
# A value that Hydra's override grammar reads back as this very string (not a number, a boolean, null, a list or
# an interpolation), and that no resolver would take apart: a word or a path.
PLAIN_WORD = re.compile(r"[A-Za-z0-9_./+-]+")
NOT_STRINGS = ("true", "false", "null", "inf", "nan")
KEYS = (*LOCATIONS, *(f"{group}.{LOCATIONS_UNDER}" for group in CONFIG_GROUPS))
MARKER = "@@nxdt-"   # every placeholder starts so


def _plain_word(value: str) -> bool:
    if not PLAIN_WORD.fullmatch(value):
        return False
    return "/" in value or ((value[0].isalpha() or value[0] == "_") and value.lower() not in NOT_STRINGS)


def split_locations(overrides: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """(the other overrides, {location key: value, the last given}), or None when a location is given in another
    form (an interpolation, a number, `+key=`), or another override touches one (`training.run={...}`,
    `~training.run`): then every override is keyed as typed."""
    kept, given = [], {}
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key in KEYS:
            if not _plain_word(value):
                return None
            given[key] = value
        else:
            kept.append(override)
    for override in kept:
        key = override.partition("=")[0].lstrip("+~")
        if key not in CONFIG_GROUPS and any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in KEYS):
            return None
    return kept, given


def place(nodes, salt: str) -> dict[str, Any] | None:
    """Sets every location of a composed config to a placeholder (`salt` makes it one no value holds by chance:
    part of the entry's key): {"placeholders": {key: placeholder},
    "defaults": {key: its own value, resolved, with the other keys' placeholders in it}}, or None when one of them
    holds something else than a string. `nodes`: the config's Nodes (OmegaConfNodes, or plain_resolve.PlainNodes)."""
    found = {}
    for key in KEYS:
        raw = nodes.raw(key)
        if raw is ABSENT:
            continue
        if not isinstance(raw, str):
            return None
        found[key] = raw
    placeholders = {key: f"{MARKER}{salt}-{i}@@" for i, key in enumerate(found)}
    for key in found:
        nodes.set(key, placeholders[key])
    defaults = {}
    for key, own in found.items():
        nodes.set(key, own)
        defaults[key] = nodes.select(key)
        nodes.set(key, placeholders[key])
        if not isinstance(defaults[key], str):
            return None
    return {"placeholders": placeholders, "defaults": defaults}


ABSENT = object()   # Nodes.raw of a key the config does not have


class OmegaConfNodes:
    """A config composed by Hydra, as `place` and `resolve_placed` read and set it."""

    def __init__(self, cfg, resolve) -> None:
        self.cfg, self.resolve = cfg, resolve

    def raw(self, key: str) -> Any:
        """The value as written (an interpolation unexpanded); a mapping or list as itself; ABSENT."""
        from omegaconf import OmegaConf

        parent, _, leaf = key.rpartition(".")
        container = OmegaConf.select(self.cfg, parent, default=None) if parent else self.cfg
        if not OmegaConf.is_dict(container) or leaf not in container:
            return ABSENT
        node = container._get_node(leaf)
        return node if OmegaConf.is_config(node) else node._value()

    def set(self, key: str, value: str) -> None:
        from omegaconf import OmegaConf

        parent, _, leaf = key.rpartition(".")
        container = OmegaConf.select(self.cfg, parent) if parent else self.cfg
        container[leaf] = value

    def select(self, key: str) -> Any:
        """The value resolved; None where it does not resolve."""
        from omegaconf import OmegaConf

        return OmegaConf.select(self.cfg, key, throw_on_resolution_failure=False, throw_on_missing=False)

    def resolve_watching(self, tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
        """The config resolved, and the resolvers that were handed an argument holding one of `tokens`."""
        with _watching_resolvers(tokens) as handed:
            general = self.resolve(self.cfg)
        return general, handed


class _watching_resolvers:
    """Within the block, whether any resolver was called with an argument that holds one of `tokens`: a value that
    does not flow into the config as text. OmegaConf keeps its resolvers in BaseContainer._resolvers; where it does
    not, every call counts as such."""

    def __init__(self, tokens):
        self.tokens, self.handed = tuple(tokens), []

    def __enter__(self) -> list[str]:
        from omegaconf.basecontainer import BaseContainer

        self.registry = getattr(BaseContainer, "_resolvers", None)
        if not isinstance(self.registry, dict):
            self.handed.append("?")
            return self.handed
        self.saved = dict(self.registry)
        for name, call in self.saved.items():
            self.registry[name] = self._watch(name, call)
        return self.handed

    def _watch(self, name, call):
        def watched(config, parent, node, args, args_str):
            if any(token in (arg if isinstance(arg, str) else repr(arg)) for arg in args for token in self.tokens):
                self.handed.append(name)
            return call(config, parent, node, args, args_str)
        return watched

    def __exit__(self, *exc) -> None:
        if isinstance(self.registry, dict):
            self.registry.clear()
            self.registry.update(self.saved)


def resolve_placed(nodes, placed: dict[str, Any], env_reads: dict[str, Any]) -> dict[str, Any] | None:
    """The config resolved with `place`'s placeholders in it, or None when one of them did not reach the config as
    text only: a resolver was handed it, an environment variable's name holds it, or a mapping's key."""
    tokens = list(placed["placeholders"].values())
    general, handed = nodes.resolve_watching(tokens)
    if handed or any(token in name for token in tokens for name in env_reads) or not _keys_plain(general, tokens):
        return None
    return general


def _keys_plain(value: Any, tokens) -> bool:
    """No placeholder in a mapping's key: fill() puts values in strings only."""
    if isinstance(value, dict):
        return all(not any(t in k for t in tokens) and _keys_plain(v, tokens) for k, v in value.items())
    if isinstance(value, list):
        return all(_keys_plain(v, tokens) for v in value)
    return True


def fill(entry: dict[str, Any], given: dict[str, str]) -> dict[str, Any] | None:
    """The entry's config with each placeholder replaced by its location's value: as given, else the entry's
    default with the other locations' values in it. None when the entry does not name a location that is given or
    the defaults read each other in a circle (a fresh compose reports what is wrong)."""
    placeholders, defaults = entry["placeholders"], entry["defaults"]
    if not set(given) <= set(placeholders) or set(defaults) != set(placeholders):
        return None
    if not placeholders:
        return entry["config"]
    pattern = re.compile("|".join(re.escape(token) for token in placeholders.values()))
    key_of = {token: key for key, token in placeholders.items()}
    values: dict[str, str] = {}

    def value(key: str, reading: tuple[str, ...]) -> str:
        if key not in values:
            if key in reading:
                raise RecursionError(key)
            text = given[key] if key in given else defaults[key]
            values[key] = pattern.sub(lambda m: value(key_of[m.group()], (*reading, key)), text)
        return values[key]

    try:
        for key in placeholders:
            value(key, ())
    except RecursionError:
        return None
    by_token = {token: values[key] for key, token in placeholders.items()}

    def put(node: Any) -> Any:
        if isinstance(node, str):
            return pattern.sub(lambda m: by_token[m.group()], node) if MARKER in node else node
        if isinstance(node, dict):
            return {k: put(v) for k, v in node.items()}
        if isinstance(node, list):
            return [put(v) for v in node]
        return node

    return put(entry["config"])
