"""nxdt-launch's own cache: the launch config of an earlier launch with the same inputs, so that a repeated launch
skips Hydra, and the job-script templates compiled to Python code.

Composing conf/ (Hydra's defaults chain, twice when the cluster switches the recipe: launcher/targets.py) and
resolving it costs most of a dry run, and importing Hydra and OmegaConf most of the rest. The result is a plain
dict that depends on nothing but what its key names:

- the overrides, as typed, in order;
- every file under the conf directory (NXDT_CONF_DIR or conf/): its path, mtime and size;
- every .py file of the launcher package (a code change invalidates), the Python version, and Hydra's and
  OmegaConf's version files;
- the working directory (${cwd:});
- and, checked on reading, the value of every environment variable ${oc.env:NAME} read (launcher/resolvers.py).

Where the launch's files go is not in the key: base_results_dir, run_name and each stage's run.name, given as a
plain word or path (`base_results_dir=/fsx/results`, `training.run.name=gpt3_175b_v2`) or not at all, are left out
of it, and the entry holds placeholders in their place (launcher/placeholders.py), filled for each launch. Where one
of them does not reach the config as text (a resolver is handed it as an argument), the entry says so, and the
launch is keyed on every override as typed.

A hit imports neither Hydra nor OmegaConf, nor does a miss that launcher/plain_compose.py composes (the subset of
Hydra that conf/ and a launch's plain overrides use; everything else is Hydra's). Nothing that failed is stored, so a mistake is reported by compose.py
every time, as before. Not cached: a file choice (training=@FILE, read from outside conf/), an override of
`hydra.*` (hydra.searchpath adds config directories), choices registered in this process's ConfigStore, a config
that could call a resolver other than those whose result these inputs fix (${now:...}), a value that JSON would
not give back unchanged, and files changed in the last two seconds (mtimes are coarser than the clock; as git's
"racily clean" entries). A damaged entry is recomposed and replaced.

Templates go through Jinja's own bytecode cache, which compiles again when a template's text changes; its key
adds Jinja's version and launcher/render.py, which sets up the environment the code is generated for.

    NXDT_LAUNCH_CACHE=off          # compose and compile every time
    NXDT_LAUNCH_CACHE=/tmp/cache   # the cache directory; default $XDG_CACHE_HOME/nxdt-launch (~/.cache/nxdt-launch)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import placeholders
from launcher.file_choices import is_file_choice
from launcher.paths import conf_dir
from launcher.plain_compose import Unsupported, registered_choices

ENV = "NXDT_LAUNCH_CACHE"
OFF = ("off", "0", "false", "no")
FORMAT = 1
MAX_ENTRIES = 256        # the least recently used beyond these are removed when an entry is written
RACY_NS = 2_000_000_000  # a file changed this recently may change again without its mtime moving

# Resolvers whose result the key fixes: ours (launcher/resolvers.py; cwd is in the key, oc.env is recorded) and
# OmegaConf's that read only the config. Not oc.create/oc.decode: they turn a string into interpolations.
DETERMINISTIC = {"multiply", "divide_ceil", "divide_floor", "trained", "trained_here", "cwd", "shared_dir", "oc.env",
                 "oc.select", "oc.deprecated", "oc.dict.keys", "oc.dict.values"}
RESOLVER_CALL = re.compile(r"\$\{\s*([\w.\-]+)\s*:")
PLAIN = (str, int, float, bool, type(None))


def cache_dir() -> Path | None:
    """None when the cache is off."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF:
        return None
    return Path(setting or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nxdt-launch")


@dataclass(frozen=True)
class Key:
    digest: str
    racy: bool   # a keyed file changed within RACY_NS: read from the cache, never written to it


def resolved(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """compose.resolve(compose.compose(overrides)) and compose's warnings, from the cache when nothing it reads has
    changed; a UserError exactly as compose.py raises it otherwise."""
    where = cache_dir()
    inputs = _inputs(overrides) if where is not None else None
    if inputs is None:
        return _compose(overrides, None, None)
    if (split := placeholders.split_locations(overrides)) is not None:
        kept, given = split
        general = _key(inputs, kept, general=True)
        path = where / "compose" / f"{general.digest}.json"
        entry = load(path)
        if entry is not None and "placeholders" in entry:
            if (cfg := placeholders.fill(entry, given)) is not None:
                return cfg, entry["warnings"]
        elif entry is None:  # compose it for every location; `None` when it cannot be
            if (made := _compose_general(kept, given, general, path, overrides)) is not None:
                return made
    key = _key(inputs, overrides)
    path = where / "compose" / f"{key.digest}.json"
    if (entry := load(path)) is not None and "config" in entry:
        return entry["config"], entry["warnings"]
    return _compose(overrides, None if key.racy else path, overrides)


def _compose(overrides: list[str], path: Path | None, typed: list[str] | None) -> tuple[dict[str, Any], list[str]]:
    from launcher.resolvers import recording_env

    warnings: list[str] = []
    with recording_env() as env_reads:
        cfg = composed(overrides, warnings)
    if path is not None and storable(cfg, typed):
        store(path, {"env": env_reads, "warnings": warnings, "config": cfg})
    return cfg, warnings


def composed(overrides: list[str], warnings: list[str] | None = None) -> dict[str, Any]:
    """compose.resolve(compose.compose(overrides)), without Hydra where launcher/plain_compose.py reproduces it (what
    a launch composes on a cache miss); Hydra names every mistake."""
    try:
        return _without_hydra(overrides, warnings)
    except Unsupported:
        from launcher.compose import compose, resolve

        return resolve(compose(overrides, warnings))


def _without_hydra(overrides: list[str], warnings: list[str] | None = None) -> dict[str, Any]:
    """compose.resolve(compose.compose(overrides)) without Hydra or OmegaConf, or Unsupported. A file given as a
    choice (`training=@FILE`) is mapped as compose.py maps it, its choices kept here rather than in Hydra's
    ConfigStore; its warnings are added to `warnings` once the compose succeeds."""
    from launcher import plain_compose, plain_resolve
    from launcher.file_choices import collecting, names_a_file

    stored: dict[str, dict] = {}
    file_warnings: list[str] = []
    if names_a_file(overrides):
        from launcher import nxdt_config

        with collecting() as stored:
            overrides, file_warnings = nxdt_config.expand(list(overrides))
    cfg = plain_resolve.resolve(plain_compose.compose(overrides, stored))
    if warnings is not None:
        warnings += file_warnings
    return cfg


def _placed(kept: list[str], given: dict[str, str], salt: str, warnings: list[str],
            env_reads: dict[str, Any], typed: list[str]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(`place`'s record, the config of `kept` resolved with a placeholder at each location): composed without
    Hydra where launcher/plain_compose.py can, else with it. The record is None when a location holds something
    else than text, the config None when it cannot hold placeholders or lacks a key that is `given`. A mistake
    raises compose.py's UserError, with `as_typed` set where it is the very error that composing `typed`, every
    override as typed, raises (_as_typed)."""
    from launcher import plain_compose, plain_resolve

    try:
        nodes = plain_resolve.PlainNodes(plain_compose.compose(kept))
        return _placed_in(nodes, given, salt, env_reads)
    except Unsupported:
        from launcher.compose import compose, resolve
        from launcher.errors import UserError

        trace: dict[str, Any] = {}
        try:
            cfg = compose(kept, warnings, trace)
        except UserError as mistake:
            mistake.as_typed = _as_typed(trace, kept, typed)
            raise
        nodes = placeholders.OmegaConfNodes(cfg, resolve)
        own = {key: nodes.raw(key) for key in placeholders.KEYS}
        try:
            return _placed_in(nodes, given, salt, env_reads)
        except UserError:
            # Resolving failed with placeholders at the locations. With one Hydra compose, composing `typed` gives
            # this config with the locations set as typed (each is a string already: `place`), nothing else: the
            # resolve of that names the mistake as typed; a mistake only the placeholders made is left to it.
            if trace["composes"] != 1 or not _locations_sound(typed):
                raise
            from omegaconf import OmegaConf

            for key, value in own.items():
                if value is not placeholders.ABSENT:
                    nodes.set(key, given.get(key, value))
            OmegaConf.clear_cache(cfg)
            try:
                resolve(cfg)
            except UserError as mistake:
                mistake.as_typed = True
                raise mistake from None
            raise


def _location_overrides(typed: list[str]) -> list[int]:
    """The positions of the overrides that split_locations takes out."""
    return [i for i, o in enumerate(typed) if "=" in o and o.partition("=")[0] in placeholders.KEYS]


def _locations_sound(typed: list[str]) -> bool:
    """Whether every location override is one Hydra takes as the plain string typed, sets as a value (not a config
    group's choice), and compose.check_overrides passes: then it is nowhere a mistake before Hydra sets it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    from launcher.compose import check_overrides
    from launcher.errors import UserError

    locations = [typed[i] for i in _location_overrides(typed)]
    parser = OverridesParser.create()
    for text in locations:
        key, _, value = text.partition("=")
        try:
            parsed = parser.parse_override(text)
        except Exception:  # Hydra's parse errors have no common base
            return False
        if parsed.type != OverrideType.CHANGE or parsed.package is not None or parsed.value() != value \
                or os.path.exists(conf_dir() / key):
            return False
    try:
        check_overrides(locations)
    except UserError:
        return False
    return True


def _as_typed(trace: dict[str, Any], kept: list[str], typed: list[str]) -> bool:
    """Whether compose.compose(typed) raises exactly the error that compose.compose(kept) raised, `trace` being
    what the latter told: `typed` is `kept` with sound location overrides (_locations_sound) among them.
    - check: check_overrides looks at one override at a time, in order, and passes every location;
    - parse: Hydra parses every override first and names the first it cannot; every location parses;
    - missing: a config Hydra could not find, in its first compose: the configs it loads are chosen by the
      config groups' overrides, the same in both, and the same recipe (targets.guess reads no location);
    - composition, in its first compose, with every location typed after every other override: Hydra sets the
      overrides in typed order and stops at the first that fails, so before it sets any location.
    A mistake in a later compose is not: composing `typed`, the first compose could stop at a location first."""
    if not _locations_sound(typed):
        return False
    error = trace.get("error")
    if error in ("check", "parse"):
        return True
    if trace.get("composes") != 1:
        return False
    if error == "missing":
        return True
    locations = _location_overrides(typed)
    return error == "composition" and (not kept or not locations or len(kept) <= min(locations))


def _placed_in(nodes, given: dict[str, str], salt: str, env_reads: dict[str, Any]):
    placed = placeholders.place(nodes, salt)
    if placed is None or not set(given) <= set(placed["placeholders"]):
        return placed, None
    return placed, placeholders.resolve_placed(nodes, placed, env_reads)


def _compose_general(kept: list[str], given: dict[str, str], key: Key, path: Path,
                     overrides: list[str]) -> tuple[dict[str, Any], list[str]] | None:
    """The config of `kept` with a placeholder at each location, stored at `path`, filled with `given`; or None
    (and an entry that says so) when it would not be what a fresh compose gives. A mistake is left to the caller's
    compose of every override as typed, which names it as always, unless it is that very error (_as_typed)."""
    from launcher.errors import UserError
    from launcher.resolvers import recording_env

    warnings: list[str] = []
    with recording_env() as env_reads:
        try:
            placed, general = _placed(kept, given, key.digest[:16], warnings, env_reads, overrides)
        except UserError as mistake:
            if getattr(mistake, "as_typed", False):
                raise
            return None
    if placed is not None and not set(given) <= set(placed["placeholders"]):
        return None  # a key this config lacks: the compose of every override names it
    if key.racy:
        path = None
    if general is None:
        if path is not None:
            store(path, {"env": env_reads, "warnings": warnings})  # a launch of these overrides is keyed as typed
        return None
    entry = {"env": env_reads, "warnings": warnings, "config": general, **placed}
    if path is not None and storable(general, overrides):
        store(path, entry)
    cfg = placeholders.fill(entry, given)
    return None if cfg is None else (cfg, warnings)


def _key(inputs: tuple[list, int], overrides: list[str], general: bool = False) -> Key:
    """`general`: the key of a config with its locations as placeholders (split_locations)."""
    material, newest = inputs
    digest = hashlib.sha256(json.dumps([FORMAT, general, list(overrides), *material]).encode()).hexdigest()
    return Key(digest, racy=newest > time.time_ns() - RACY_NS)


def _inputs(overrides: list[str]) -> tuple[list, int] | None:
    """What a key names besides the overrides, and the newest file's mtime; None when these overrides read
    something a key cannot name."""
    for override in overrides:
        name, _, value = override.partition("=")
        name = name.lstrip("+~")
        if name == "hydra" or name.startswith("hydra.") or is_file_choice(value):
            return None
    if registered_choices():
        return None
    try:
        cwd = os.getcwd()
        conf = conf_dir()
        files = _stamps(conf, lambda name: True) + _stamps(Path(__file__).parent, lambda name: name.endswith(".py"))
        versions = [_package_file("hydra", "__init__.py"), _package_file("omegaconf", "version.py")]
    except OSError:  # a working directory or a file that is gone: compose reports what matters
        return None
    if None in versions:
        return None
    return [sys.version, cwd, str(conf), versions, files], max((mtime for _, mtime, _ in files), default=0)


def _stamps(root: Path, wanted) -> list[tuple[str, int, int]]:
    """(path, mtime_ns, size) of every wanted file under root, in a fixed order."""
    stamps = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if wanted(name):
                path = os.path.join(folder, name)
                stat = os.stat(path)
                stamps.append((path, stat.st_mtime_ns, stat.st_size))
    if not stamps:
        raise FileNotFoundError(root)
    return stamps


def _package_file(package: str, name: str) -> str | None:
    """The text of a package's file that holds its version, found without importing it."""
    from importlib.util import find_spec

    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return f"{folder}:{(folder / name).read_text()}"


def load(path: Path) -> dict[str, Any] | None:
    """The entry, or None when there is none, it is damaged, or an environment variable it read has changed."""
    try:
        data = path.read_bytes()
        header, _, body = data.partition(b"\n")
        if json.loads(header) != {"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest()}:
            return None
        entry = json.loads(body)
        if any(os.environ.get(name) != value for name, value in entry["env"].items()):
            return None
        if not isinstance(entry.get("config", {}), dict) or not isinstance(entry["warnings"], list):
            return None
        if "placeholders" in entry and not (isinstance(entry["placeholders"], dict) and "config" in entry
                                            and isinstance(entry["defaults"], dict)):
            return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    try:
        os.utime(path)  # recently used: kept when old entries are removed
    except OSError:
        pass
    return entry


def storable(cfg: dict[str, Any], overrides: list[str]) -> bool:
    """Whether the entry would give back exactly this config: its values come back from JSON unchanged, and every
    resolver the config could call (anywhere in conf/ or the overrides) is one whose result the key fixes."""
    if not _plain(cfg):
        return False
    texts = list(overrides)
    try:
        for folder, _, names in os.walk(conf_dir(), followlinks=True):
            texts += [Path(folder, name).read_text(errors="replace") for name in names]
    except OSError:
        return False
    return all(name in DETERMINISTIC for text in texts for name in RESOLVER_CALL.findall(text))


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return type(value) in PLAIN


def store(path: Path, entry: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed over it); a cache that cannot be written is skipped."""
    import tempfile

    body = json.dumps(entry, separators=(",", ":")).encode()
    header = json.dumps({"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest()}).encode()
    temporary = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        with os.fdopen(descriptor, "wb") as file:
            file.write(header + b"\n" + body)
        os.replace(temporary, path)
        temporary = None
        _prune(path.parent)
    except OSError:
        pass
    finally:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def _prune(folder: Path) -> None:
    entries = []
    for path in folder.glob("*.json"):
        try:
            entries.append((path.stat().st_mtime_ns, path))
        except OSError:  # removed by another launch meanwhile
            continue
    for _, path in sorted(entries)[:-MAX_ENTRIES]:
        path.unlink(missing_ok=True)


def lm_eval_catalog():
    """lm-eval's own task index as the name and data checks read it (runtime/evaluate/lm_tasks.py Catalog), built
    once per lm-eval installation and kept here: building it reads ~15,000 task files (~20 s of CPU on a small
    host), and a launch that names lm-eval tasks checks them before it submits."""
    from runtime.evaluate import lm_tasks

    where = cache_dir()
    path = None
    if where is not None:
        stamp = json.dumps(lm_tasks.own_tasks_stamp(), sort_keys=True).encode()
        path = where / "lm_eval" / f"{hashlib.sha256(stamp).hexdigest()}.json"
        entry = load(path)
        if entry is not None and isinstance(entry.get("catalog"), dict):
            return lm_tasks.Catalog(entry["catalog"])
    catalog = lm_tasks.Catalog.of(lm_tasks.task_manager(None, defaults=True))
    if path is not None:
        store(path, {"env": {}, "warnings": [], "catalog": catalog.entries})
    return catalog


def template_cache(environment_source: str):
    """A Jinja bytecode cache under the cache directory, or None when the cache is off. `environment_source`: the
    file that sets up the Jinja environment the code is generated for (its options shape that code)."""
    where = cache_dir()
    if where is None:
        return None
    import jinja2

    class TemplateCache(jinja2.FileSystemBytecodeCache):
        """Jinja's, keyed also on what the generated code depends on besides the template's text, and never a
        reason for a launch to fail: a damaged file compiles again, an unwritable directory is skipped."""

        def get_cache_key(self, name, filename=None):
            stat = os.stat(environment_source)
            return super().get_cache_key(f"{name}|{jinja2.__version__}|{stat.st_mtime_ns}|{stat.st_size}", filename)

        def load_bytecode(self, bucket):
            try:
                super().load_bytecode(bucket)
            except Exception:  # the pickled checksum or the marshalled code is damaged: Jinja raises varied errors
                bucket.reset()

        def dump_bytecode(self, bucket):
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                super().dump_bytecode(bucket)
            except OSError:
                pass

    return TemplateCache(str(where / "templates"))
