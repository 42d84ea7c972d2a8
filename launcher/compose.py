"""Compose the launch config from conf/ with Hydra's compose API, and turn Hydra's errors into one-line,
fixable messages. Hydra is imported here only, when a command actually needs a config."""

from __future__ import annotations

import difflib
import re
from typing import Any

from launcher.errors import UserError
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


def compose(overrides: list[str], warnings: list[str] | None = None):
    """The composed (unresolved) DictConfig for these Hydra overrides, or a UserError. An NxD Training file given
    as `training=@FILE` is mapped first (launcher/nxdt_config.py); what it ignores is added to `warnings`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    from launcher import nxdt_config

    register_resolvers()
    overrides, file_warnings = nxdt_config.expand(list(overrides))
    if warnings is not None:
        warnings += file_warnings
    typed = list(overrides)
    overrides = [_with_open_map_prefix(o) for o in overrides]
    try:
        with initialize_config_dir(str(conf_dir()), version_base=None, job_name="nxdt_launch"):
            return hydra_compose("config", overrides=overrides)
    except OverrideParseException as e:
        bad = typed[overrides.index(_first_unparsable(overrides))] if overrides else ""
        first_line = str(e).splitlines()[0].replace(f"'{_with_open_map_prefix(bad)}'", f"'{bad}'")
        raise UserError(
            f"override {bad!r} is not valid Hydra syntax ({first_line}); "
            "quote values with spaces or shell characters: key='value'"
        ) from None
    except MissingConfigException as e:
        found = re.search(r"Could not find '([^']+)'", str(e))
        raise _unknown_choice_error(found.group(1) if found else str(e)) from None
    except ConfigCompositionException as e:
        cause = e.__cause__
        full_key = getattr(cause, "full_key", None)
        parent = getattr(cause, "parent_node", None)
        if full_key and parent is not None and hasattr(parent, "keys"):
            raise _unknown_key_error(full_key, [str(k) for k in parent.keys()]) from None
        raise UserError(str(e).splitlines()[0]) from None


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
        raise UserError(f"{key}: {message}") from None
