"""Compose the launch config from conf/ with Hydra's compose API, and turn Hydra's errors into one-line,
fixable messages. Hydra is imported here only, when a command actually needs a config."""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable

from launcher.errors import UserError
from launcher.file_choices import names_a_file
from launcher.paths import CONFIG_GROUPS, conf_dir, group_choices
from launcher.resolvers import register_resolvers

# Maps whose keys are the user's to choose: `env_vars.FOO=1` adds FOO without Hydra's `+` prefix.
OPEN_MAPS = ("env_vars.", "cluster.env_vars.")


def _with_open_map_prefix(override: str) -> str:
    if override.startswith(OPEN_MAPS) and "=" in override:
        return "++" + override
    return override


def _closest(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {match[0]!r}? " if match else ""


def _unknown_key_error(full_key: str, parent_keys: list[str]) -> UserError:
    parent, _, leaf = full_key.rpartition(".")
    where = f"under {parent}" if parent else "at the top level"
    parent_keys = [k for k in parent_keys if k != "hydra"]  # Hydra's own node, not the user's
    hint = _closest(leaf, parent_keys)
    if hint and parent:
        hint = hint.replace("mean '", f"mean '{parent}.")
    listing = ", ".join(sorted(parent_keys)) if len(parent_keys) <= 30 else f"{len(parent_keys)} keys"
    return UserError(
        f"unknown key {full_key!r}: {hint}valid keys {where}: {listing} "
        f"(prefix the override with '+' to add a new key on purpose)"
    )


def _unknown_choice_error(missing: str) -> UserError:
    group = next((g for g in CONFIG_GROUPS if missing == g or missing.startswith(g + "/")), None)
    if group is None:
        return UserError(f"config {missing!r} not found under {conf_dir()}")
    choice = missing[len(group) + 1 :]
    choices = group_choices(group)
    return UserError(
        f"{group}={choice}: no such choice; {_closest(choice, choices)}valid choices: {', '.join(choices)}"
    )


def _registered_choices(group: str) -> list[str]:
    """Choices stored in Hydra's ConfigStore under `group` (an NxD Training file given as training=@FILE)."""
    from hydra.core.config_store import ConfigStore

    def walk(node: dict, prefix: str) -> list[str]:
        names = []
        for name, child in node.items():
            if isinstance(child, dict):
                names += walk(child, f"{prefix}{name}/")
            else:
                names.append(prefix + str(name).removesuffix(".yaml"))
        return names

    node = ConfigStore.instance().repo.get(group)
    return walk(node, "") if isinstance(node, dict) else []


def _value_text(override: str) -> str:
    return override.partition("=")[2]


def _typed_value(full_key: str, typed: list[str]) -> str:
    """The value the user typed for `full_key` (the last override of it wins, as in Hydra)."""
    return next((_value_text(o) for o in reversed(typed) if o.partition("=")[0].lstrip("+~") == full_key), "")


def check_overrides(typed: list[str], groups: tuple[str, ...] = CONFIG_GROUPS,
                    choices_of: Callable[[str], list[str]] = group_choices) -> None:
    """What Hydra would take for something else or fail on with a traceback, named as the user typed it. An
    override Hydra cannot parse at all is left to Hydra's own syntax error, reported by the caller. `groups` are the
    config groups of the config being composed, `choices_of` lists a group's choices (cluster-config has its own)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    parser = OverridesParser.create()
    for text in typed:
        if not text.strip():  # '' from a shell variable that was never set, most often
            raise UserError(f"override {text!r} is empty; remove it, or write KEY=VALUE")
        try:
            override = parser.parse_override(_with_open_map_prefix(text))
        except Exception:  # Hydra's parse errors have no common base; compose() reports them
            continue
        key = override.key_or_group
        if not key:
            raise UserError(f"override {text!r} has no key before '='; write KEY=VALUE, "
                            f"e.g. training.trainer.max_steps=100")
        if override.is_sweep_override():
            raise UserError(f"{key}: {_value_text(text)!r} is a Hydra sweep, and nxdt-launch launches one config at a "
                            f"time (there is no --multirun); give one value, and quote one that holds commas: "
                            f"{key}='a,b'")
        if key in groups and override.package is None and override.type != OverrideType.DEL:
            _check_group_choice(key, override.value(), text, choices_of(key))


def _check_group_choice(group: str, value: Any, typed: str, choices: list[str]) -> None:
    """A group takes the name of one of its configs; Hydra would resolve '../x' relative to the group, or fail on
    a number, and then name some other file. Other unknown names are left to Hydra, which also searches the
    directories of `hydra.searchpath` (an autoconfig result) and reports a missing one (_unknown_choice_error)."""
    known = set(choices) | set(_registered_choices(group))
    for choice in value if isinstance(value, list) else [value]:
        if not isinstance(choice, str) or not choice:
            raise UserError(f"{group}={_value_text(typed)}: a config group takes the name of one of its configs; "
                            f"valid choices: {', '.join(choices)}")
        escapes = choice.startswith("/") or any(part in ("..", ".") for part in choice.split("/"))
        if escapes and choice not in known:
            raise UserError(f"{group}={choice}: no such choice; {_closest(choice, choices)}"
                            f"valid choices: {', '.join(choices)}")


_ENV_MAPS = ("env_vars", "cluster.env_vars")


def _type_error(full_key: str, cause: Exception, typed: list[str]) -> UserError:
    """An override whose value is of another kind than what the config holds at that key."""
    value = _typed_value(full_key, typed)
    message = str(cause).splitlines()[0]
    if full_key in _ENV_MAPS:
        return UserError(f"{full_key}: must be a mapping of NAME: value, not {value}; set one variable per override, "
                         f"e.g. {full_key}.NCCL_DEBUG=INFO")
    if message.startswith("Cannot merge DictConfig with"):
        return UserError(f"{full_key}: {value} replaces a mapping of keys; set its keys one at a time, "
                         f"e.g. {full_key}.KEY=VALUE")
    if message.startswith("Cannot merge ListConfig with"):
        return UserError(f"{full_key}: {value} replaces a list; give a list, e.g. {full_key}=[a,b]")
    return UserError(f"{full_key}: {value} does not fit there ({message})")


def compose(overrides: list[str], warnings: list[str] | None = None, trace: dict[str, Any] | None = None):
    """_compose, with the choices an NxD Training or NeMo file (`training=@FILE`) stores in Hydra's ConfigStore kept
    for this compose alone: a later compose in the same process (autoconfig's trials, a test session) neither sees
    them nor loses the plain composer to them (plain_compose.registered_choices)."""
    if not names_a_file(overrides):
        return _compose(overrides, warnings, trace)
    from hydra.core.config_store import ConfigStore

    def tree(node: dict) -> dict:
        return {name: tree(child) if isinstance(child, dict) else child for name, child in node.items()}

    repo = ConfigStore.instance().repo
    kept = {group: tree(repo[group]) for group in CONFIG_GROUPS if group in repo}
    try:
        return _compose(overrides, warnings, trace)
    finally:
        for group in CONFIG_GROUPS:
            repo.pop(group, None)
        repo.update(kept)


def _compose(overrides: list[str], warnings: list[str] | None = None, trace: dict[str, Any] | None = None):
    """The composed (unresolved) DictConfig for these Hydra overrides, or a UserError. An NxD Training file given
    as `training=@FILE` is mapped first (launcher/nxdt_config.py); what it ignores is added to `warnings`. `trace`,
    when given, is told how far it got (launcher/cache.py reads it to know whether a mistake is named as the
    overrides it composed without the launch's locations would name it): "composes", the Hydra composes begun, and
    on a mistake "error", where it was found: check (check_overrides), parse, missing (a config that is not there),
    composition (Hydra's defaults or an override), targets."""
    trace = {} if trace is None else trace
    trace.update(composes=0, error="check")
    from hydra import compose as compose_once
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    from launcher import targets

    register_resolvers()
    if names_a_file(overrides):  # a file choice, perhaps: imported only for one
        from launcher import nxdt_config

        overrides, file_warnings = nxdt_config.expand(list(overrides))
        if warnings is not None:
            warnings += file_warnings
    typed = list(overrides)
    check_overrides(typed)
    trace["error"] = "targets"
    overrides = [_with_open_map_prefix(o) for o in overrides]

    def hydra_compose(name, overrides):
        trace["composes"] += 1
        return compose_once(name, overrides=overrides)

    try:
        with initialize_config_dir(str(conf_dir()), version_base=None, job_name="nxdt_launch"):
            # The recipe that holds the training recipe's layout for the cluster's hardware, with the same
            # overrides (launcher/targets.py): read from the files first, and kept when the composed config
            # names the same target; else the training recipe is composed as given and switched.
            if (guessed := targets.guess(overrides)) is not None:
                target, recipe = guessed
                cfg = hydra_compose("config", overrides=_with_training(overrides, recipe))
                if targets.cluster_target(cfg) == target and cfg.training.get("targets") is None:
                    targets.apply(cfg)
                    return cfg
            cfg = hydra_compose("config", overrides=overrides)
            if (recipe := targets.apply(cfg)) is not None:
                cfg = hydra_compose("config", overrides=_with_training(overrides, recipe))
                if targets.apply(cfg) is not None:
                    raise UserError(f"training={recipe}: a target's own recipe must be pinned to its layout; "
                                    f"set `targets: null` in it")
        return cfg
    except OverrideParseException as e:
        trace["error"] = "parse"
        bad = typed[overrides.index(_first_unparsable(overrides))] if overrides else ""
        first_line = str(e).splitlines()[0].replace(f"'{_with_open_map_prefix(bad)}'", f"'{bad}'")
        raise UserError(
            f"override {bad!r} is not valid Hydra syntax ({first_line}); "
            "quote values with spaces or shell characters: key='value'"
        ) from None
    except MissingConfigException as e:
        trace["error"] = "missing"
        found = re.search(r"Could not find '([^']+)'", str(e))
        raise _unknown_choice_error(found.group(1) if found else str(e)) from None
    except ConfigCompositionException as e:
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, GrammarParseError
        from omegaconf.errors import ValidationError

        trace["error"] = "composition"
        cause = e.__cause__
        full_key = getattr(cause, "full_key", None)
        parent = getattr(cause, "parent_node", None)
        if isinstance(cause, GrammarParseError) and full_key:
            raise UserError(f"{full_key}: {_typed_value(full_key, typed)} is not a valid ${{...}} interpolation "
                            f"({str(cause).splitlines()[0]}); close it, or write a literal '${{' as '\\${{'") from None
        if isinstance(cause, (ConfigTypeError, ValidationError)) and full_key:
            raise _type_error(full_key, cause, typed) from None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and full_key and parent is not None \
                and hasattr(parent, "keys"):
            raise _unknown_key_error(full_key, [str(k) for k in parent.keys()]) from None
        raise UserError(str(e).splitlines()[0]) from None


def _with_training(overrides: list[str], recipe: str) -> list[str]:
    return [o for o in overrides if o.partition("=")[0] != "training"] + [f"training={recipe}"]


def _first_unparsable(overrides: list[str]) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except Exception:
            return override
    return overrides[-1]


def resolve(cfg) -> dict[str, Any]:
    """Every interpolation expanded into a plain dict; a broken one is named by its key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        message = str(e).splitlines()[0]
        # `training.model=5` composes, and fails where another key reads through it: name the key that was set.
        replaced = re.search(r"Error trying to access (\S+): node `([^`]+)` is not a container", message)
        if replaced:
            node = replaced.group(2)
            raise UserError(f"{node}: {_node_value(cfg, node)} replaces a mapping that other keys read ({key} reads "
                            f"{replaced.group(1)}); set its keys one at a time, e.g. {node}.KEY=VALUE") from None
        raise UserError(f"{key}: {message}") from None


def _node_value(cfg, key: str) -> str:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return repr(OmegaConf.select(cfg, key, throw_on_resolution_failure=False))
    except OmegaConfBaseException:  # only for the message: an unreadable node is described by its key alone
        return "a value"
