"""The launch config composed from conf/ into plain dicts, without importing Hydra or OmegaConf: what a launch
composes when its cache misses (launcher/cache.py). A Hydra compose and OmegaConf's nodes cost most of a dry run;
this is the same composition for the subset of Hydra that conf/ and a launch's overrides use, and nothing else.

Reproduced exactly (tests/launcher/test_plain_compose.py composes every option of every group both ways):

- defaults lists of `_self_`, `/group/option@_here_` and, in the root config, `group: option`; a recipe's
  `override /group@_global_.group: option` (the nearest, latest one wins, the command line over all), expanded in
  Hydra's order (each list from its end) and merged as OmegaConf merges plain values (mappings key by key, all else
  replaced);
- YAML read as OmegaConf reads it (no timestamps; a number only in its plain decimal forms);
- overrides `key=value`, `+key=value`, `++key=value`, `group=option`, `+group=option`, with values that are words,
  paths, integers, decimals, true/false/null or flat lists of those (`stages=[training,conversion]`);
- the cluster's training recipe (launcher/targets.py), applied as compose.py applies it.

Anything else raises Unsupported and the caller composes with Hydra (launcher/compose.py), which stays the
reference and reports every mistake: sweeps, `~key`, quoted or interpolated values, a choice that is not a file
under conf/, an unknown key, a `???`, a YAML feature or number form outside the above, choices registered in
Hydra's ConfigStore. Interpolations are resolved by launcher/plain_resolve.py.

    NXDT_LAUNCH_COMPOSE=hydra      # compose every launch with Hydra"""

from __future__ import annotations

import os
import re
from typing import Any

from launcher.paths import conf_dir


SWITCH = "NXDT_LAUNCH_COMPOSE"   # =hydra: every launch composes with Hydra (the reference), as before this module


class Unsupported(Exception):
    """Outside what this module reproduces: compose with Hydra instead."""


NAME = r"[A-Za-z_][A-Za-z0-9_]*"
OVERRIDE = re.compile(rf"(\+{{0,2}})({NAME}(?:\.{NAME})*)=(.+)", re.S)
INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
FLOAT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)")
WORD = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
NOT_WORDS = ("true", "false", "null", "inf", "nan")
# An interpolation of a key, which Hydra keeps as text for OmegaConf to resolve (plain_resolve.py here).
INTERPOLATION = rf"\$\{{{NAME}(?:\.{NAME})*\}}"
# A quoted string with no backslash or quote of its own kind inside, and no '$' but in such interpolations: Hydra
# reads it as its inner text.
QUOTED = re.compile(rf"'((?:[^'\\$]|{INTERPOLATION})*)'|\"((?:[^\"\\$]|{INTERPOLATION})*)\"")
CHOICE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")
OPEN_MAPS = ("env_vars.", "cluster.env_vars.")   # as compose.py: keys the user adds without '+'


def scalar(text: str) -> Any:
    """An override's value as Hydra's grammar reads it, for the forms whose reading is plain."""
    if INT.fullmatch(text):
        return int(text)
    if FLOAT.fullmatch(text):
        return float(text)
    if text in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[text]
    if WORD.fullmatch(text) and text.lower() not in NOT_WORDS:
        return text
    if re.fullmatch(INTERPOLATION, text):
        return text
    if quoted := QUOTED.fullmatch(text):
        return quoted.group(1) if quoted.group(1) is not None else quoted.group(2)
    raise Unsupported(text)


def _value(text: str) -> Any:
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        return [scalar(item) for item in inner.split(",")] if inner else []
    return scalar(text)


def parse(override: str) -> tuple[str, str, Any]:
    """(prefix '' | '+' | '++', key, value) of one override, or Unsupported."""
    found = OVERRIDE.fullmatch(override)
    if found is None:
        raise Unsupported(override)
    prefix, key, text = found.groups()
    if key.split(".")[0] == "hydra":
        raise Unsupported(override)
    if not prefix and key.startswith(OPEN_MAPS):
        prefix = "++"
    return prefix, key, _value(text)


# --- conf/'s files, read as OmegaConf reads them --------------------------------------------------------------

def _loader():
    """PyYAML's safe loader (libyaml's parser where there is one) reading plain scalars as OmegaConf's loader does:
    no timestamps (text), and a scalar that looks like a number read only in its plain decimal forms; the other
    number forms (1_000, 0x1f, 1:30, .inf, 1.2.3) are Unsupported."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    numeric = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"}
    # What PyYAML reads as a number, and a superset of the floats OmegaConf's loader adds (1e-5, 1.5e5).
    numbers = [regexp for resolvers in base.yaml_implicit_resolvers.values() for tag, regexp in resolvers
               if tag in numeric] + [re.compile(r"[-+]?(?:\.[A-Za-z]+|[0-9._][0-9_.:eE+-]*)$")]

    class Loader(base):
        def construct_mapping(self, node, deep=False):
            keys = [key.value for key, _ in node.value]
            if len(set(keys)) != len(keys):  # OmegaConf refuses a duplicate key
                raise Unsupported("duplicate key")
            return super().construct_mapping(node, deep=deep)

        def construct_number(self, node):
            text = self.construct_scalar(node)
            if INT.fullmatch(text):
                return int(text)
            if FLOAT.fullmatch(text):
                return float(text)
            if any(regexp.match(text) for regexp in numbers):
                raise Unsupported(text)
            return text

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in numeric]
        for first, resolvers in base.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:nxdt:number", re.compile(r"[-+]?(?:\.[A-Za-z]+|[0-9._][0-9A-Za-z_.:+-]*)$"),
                                 list("-+0123456789."))
    Loader.add_constructor("tag:nxdt:number", Loader.construct_number)
    return Loader


_LOADER: list = []
HEADER = re.compile(r"^\s*#\s*@", re.M)


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and not set(k) & set(".[]$") and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, str):
        return value != "???"
    return value is None or type(value) in (int, float, bool)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class Files:
    """conf/'s files, each read once: (its config without `defaults`, its defaults list). `stored` adds choices
    that are no file ({"group/name": config}: what an NxD Training or NeMo file maps to, launcher/nxdt_config.py),
    read as Hydra reads the same config from its ConfigStore."""

    def __init__(self, stored: dict[str, dict] | None = None) -> None:
        self.root = conf_dir()
        self.read: dict[str, tuple[dict, list]] = {}
        self.stored = stored or {}

    def exists(self, path: str) -> bool:
        return path in self.stored or (self.root / f"{path}.yaml").is_file()

    def load(self, path: str) -> tuple[dict, list]:
        if path not in self.read and path in self.stored:
            data = _copy(self.stored[path])
            defaults = data.pop("defaults", []) if isinstance(data, dict) else None
            if not isinstance(defaults, list) or not _plain(data):
                raise Unsupported(path)
            self.read[path] = data, defaults
        if path not in self.read:
            try:
                text = (self.root / f"{path}.yaml").read_text(encoding="utf-8")
            except (OSError, UnicodeError):
                raise Unsupported(path) from None
            if text not in _PARSED:
                _PARSED[text] = _parse(text, path)
            self.read[path] = _PARSED[text]
        config, defaults = self.read[path]
        return _copy(config), defaults


# A file's text -> what load() makes of it, for every compose of this process: the reading depends on the text
# alone (read again each time, so a changed file is parsed again), and load() hands out copies. A process that
# composes many times (a test session, tab completion) parses each file once.
_PARSED: dict[str, tuple[dict, list]] = {}


def _parse(text: str, path: str) -> tuple[dict, list]:
    import yaml

    if not _LOADER:
        _LOADER.append(_loader())
    try:
        data = yaml.load(text, Loader=_LOADER[0])
    except yaml.YAMLError:
        raise Unsupported(path) from None
    if HEADER.search(text[:512]) or not isinstance(data if data is not None else {}, dict):
        raise Unsupported(path)  # a `# @package` header, or not a mapping
    data = data or {}
    defaults = data.pop("defaults", [])
    if not isinstance(defaults, list) or not _plain(data):
        raise Unsupported(path)
    return data, defaults


# --- the defaults list, in Hydra's order -----------------------------------------------------------------------

def _entries(path: str, defaults: list, root: bool) -> list[tuple[str, str, str]]:
    """(kind, what, option) for each entry: ('self', '', ''), ('config', path, ''), ('group', group, option),
    ('override', group, option)."""
    entries = []
    for item in defaults:
        if item == "_self_":
            entries.append(("self", "", ""))
        elif isinstance(item, str) and item.startswith("/") and item.endswith("@_here_") \
                and CHOICE.fullmatch(item[1:-7]):
            entries.append(("config", item[1:-7], ""))   # absolute, in the package of the config that names it
        elif isinstance(item, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", item):
            folder = path.rpartition("/")[0]             # relative: in the same group and package
            entries.append(("config", f"{folder}/{item}" if folder else item, ""))
        elif isinstance(item, dict) and len(item) == 1:
            (key, option), = item.items()
            if not isinstance(option, str) or not CHOICE.fullmatch(option):
                raise Unsupported(path)
            overridden = re.fullmatch(rf"override /({NAME})@_global_\.({NAME})", key)
            if root and re.fullmatch(NAME, key):
                entries.append(("group", key, option))
            elif not root and overridden and overridden.group(1) == overridden.group(2):
                entries.append(("override", overridden.group(1), option))
            else:
                raise Unsupported(path)
        else:
            raise Unsupported(path)
    kinds = [kind for kind, _, _ in entries]
    if kinds.count("self") != 1:
        raise Unsupported(path)  # Hydra adds a missing _self_ (and warns); ours name it
    first_override = kinds.index("override") if "override" in kinds else len(kinds)
    if any(k in ("config", "group") for k in kinds[first_override:]):
        raise Unsupported(path)  # Hydra: overrides must be at the end of the defaults list
    return entries


class _Tree:
    """The configs to merge, in order, as (path, package): Hydra's defaults tree, walked as it walks it."""

    def __init__(self, files: Files, choices: dict[str, str], appended: list[tuple[str, str]]):
        self.files, self.appended = files, appended
        self.choices = dict(choices)          # group -> option; the first registered wins (the command line's)
        self.unused = set(choices)
        self.groups: list[str] = []

    def expand(self, path: str, package: str, root: bool = False) -> list[tuple[str, str]]:
        _, defaults = self.files.load(path)
        if not defaults and not (root and self.appended):
            return [(path, package)]
        entries = _entries(path, defaults, root)
        if root:
            entries += [("group", group, option) for group, option in self.appended]
        for kind, group, option in entries:
            if kind == "override" and group not in self.choices:
                self.choices[group] = option
                self.unused.add(group)
        parts = []
        for kind, what, option in reversed(entries):
            if kind == "self":
                parts.append([(path, package)])
            elif kind == "config":
                parts.append(self.expand(what, package))
            elif kind == "group":
                if what in self.choices:
                    option = self.choices[what]
                    self.unused.discard(what)
                self.groups.append(what)
                parts.append(self.expand(f"{what}/{option}", what))
        return [item for part in reversed(parts) for item in part]


def _merge(dest: dict, src: dict) -> None:
    """OmegaConf's merge of plain configs: mappings key by key, everything else replaced."""
    for key, value in src.items():
        if key not in dest:
            dest[key] = value
            continue
        old = dest[key]
        if isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value)
        elif isinstance(old, (dict, list)) and isinstance(value, (dict, list)) and type(old) is not type(value):
            raise Unsupported(key)  # OmegaConf: cannot merge a mapping with a list
        elif isinstance(old, str) and "${" in old and isinstance(value, (dict, list)):
            raise Unsupported(key)  # OmegaConf merges into the node the interpolation names
        else:
            dest[key] = value


# --- overrides of values ------------------------------------------------------------------------------------------

def _set(cfg: dict, prefix: str, key: str, value: Any) -> None:
    """Hydra's application of `[+|++]key=value` to a composed config in struct mode (OmegaConf.update)."""
    *parents, leaf = key.split(".")
    node = cfg
    for name in parents:
        if name not in node:
            if not prefix:
                raise Unsupported(key)  # Hydra: no such key (compose.py names it)
            node[name] = {}
        node = node[name]
        if not isinstance(node, dict):
            raise Unsupported(key)
    old = node.get(leaf)
    if isinstance(old, dict):
        raise Unsupported(key)
    if leaf not in node and not prefix:
        raise Unsupported(key)
    if prefix == "+" and (isinstance(old, str) and "${" in old or old is not None and not isinstance(value, list)):
        raise Unsupported(key)  # Hydra: an item is already there (it resolves an interpolation to see)
    if isinstance(old, list) and not isinstance(value, list):
        raise Unsupported(key)
    node[leaf] = value


# --- the launch config ----------------------------------------------------------------------------------------------

def _compose_once(files: Files, overrides: list[tuple[str, str, Any]]) -> dict:
    choices: dict[str, str] = {}
    appended: list[tuple[str, str]] = []
    values = []
    for prefix, key, value in overrides:
        if (files.root / key).is_dir():  # a config group (Hydra: group_exists)
            if prefix == "++" or not isinstance(value, str) or not CHOICE.fullmatch(value) \
                    or ".." in value.split("/") or not files.exists(f"{key}/{value}"):
                raise Unsupported(key)
            if key in choices or any(key == group for group, _ in appended):
                raise Unsupported(key)
            if prefix:
                appended.append((key, value))
            else:
                choices[key] = value
        else:
            values.append((prefix, key, value))
    tree = _Tree(files, choices, appended)
    order = tree.expand("config", "", root=True)
    if tree.unused or len(set(tree.groups)) != len(tree.groups):
        raise Unsupported("defaults")  # Hydra: an override with no match, or a group listed twice
    cfg: dict = {}
    for path, package in order:
        config, _ = files.load(path)
        _merge(cfg, {package: config} if package else config)
    if "hydra" in cfg:
        raise Unsupported("hydra")
    for prefix, key, value in values:
        _set(cfg, prefix, key, _copy(value))
    return cfg


def registered_choices() -> bool:
    """Whether this process registered config choices in Hydra's ConfigStore (a training=@FILE launch before this
    one, in tests or autoconfig): a config composed here could depend on them."""
    import sys

    from launcher.paths import CONFIG_GROUPS

    module = sys.modules.get("hydra.core.config_store")
    if module is None:
        return False
    repo = module.ConfigStore.instance().repo
    return any(group in repo for group in CONFIG_GROUPS)


def compose(overrides: list[str], stored: dict[str, dict] | None = None) -> dict:
    """The launch config of these overrides, unresolved: OmegaConf.to_container(compose.compose(overrides),
    resolve=False), the training recipe chosen for the cluster; or Unsupported. `stored`: the choices a file
    launch maps to (Files)."""
    from launcher import targets
    from launcher.errors import UserError

    if os.environ.get(SWITCH, "").strip().lower() == "hydra" or registered_choices():
        raise Unsupported("ConfigStore")
    parsed = [parse(o) for o in overrides]
    files = Files(stored)
    try:
        if (guessed := targets.guess(overrides)) is not None:
            target, recipe = guessed
            cfg = _compose_once(files, _with_training(parsed, recipe))
            _readable(cfg)
            if targets.cluster_target(cfg) == target and isinstance(cfg.get("training"), dict) \
                    and cfg["training"].get("targets") is None:
                targets.apply(cfg)
                return cfg
        cfg = _compose_once(files, parsed)
        _readable(cfg)
        if (recipe := targets.apply(cfg)) is not None:
            cfg = _compose_once(files, _with_training(parsed, recipe))
            _readable(cfg)
            if targets.apply(cfg) is not None:
                raise Unsupported("targets")  # compose.py names the recipe that must be pinned
    except UserError:
        raise Unsupported("targets") from None
    return cfg


def _with_training(parsed: list[tuple[str, str, Any]], recipe: str) -> list[tuple[str, str, Any]]:
    return [o for o in parsed if (o[0], o[1]) != ("", "training")] + [("", "training", recipe)]


def _readable(cfg: dict) -> None:
    """What launcher/targets.py reads holds no interpolation: OmegaConf would resolve one there, a plain config
    would not."""
    from launcher.stages import TRAINER_STAGES

    def part(key: str, *inner: str) -> list:
        node = cfg.get(key)
        return [node.get(k) for k in inner] if isinstance(node, dict) else [node]

    read = part("cluster", "neuron") + part("cluster_validation", "accelerator", "devices")
    read += [value for stage in TRAINER_STAGES for value in part(stage, "targets")]
    if "${" in repr(read):
        raise Unsupported("targets")
