# The one reader for every stage config: typed, path-aware access to a mapping of the resolved YAML.
#
# A bad value is recorded as one line naming the full key (`training.model.optim.lr: 'fast' is not a number`)
# and the getter returns None, so a config with several mistakes reports all of them at once. The stage parsers
# (training.py, conversion.py, ...) read every value first, then run the rules of rules.py on the typed values,
# and raise ConfigErrors if anything was recorded. Standard library only: the launcher imports this at launch.
from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

REQUIRED = object()
INT64_MAX = 2**63 - 1


class ConfigErrors(ValueError):
    """Every problem found in a stage config, one line each (the CLI prints them as `error: ...`, exit 2)."""

    def __init__(self, problems: Sequence[str]):
        assert problems, "ConfigErrors names at least one problem"
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class Report:
    """What a parse found: errors stop the launch (and the job); warnings are printed and the launch goes on."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, message: str | None) -> None:
        if message and message not in self.errors:
            self.errors.append(message)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def raise_if_any(self) -> None:
        if self.errors:
            raise ConfigErrors(self.errors)


def closest(word: str, choices: Sequence[str]) -> str:
    """`did you mean 'x'? ` for a near miss, else ''."""
    names = [str(c) for c in choices]
    match = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    # A shortened name ('Cosine' for 'CosineAnnealing') is a near miss too.
    match = match or [n for n in names if str(word) and n.lower().startswith(str(word).lower())][:1]
    return f"did you mean {match[0]!r}? " if match else ""


def show(value: Any) -> str:
    return "null" if value is None else repr(value)


class Section:
    """One mapping of a stage config. Getters return the typed value, or None after recording an error."""

    def __init__(self, data: Any, path: str, report: Report):
        self.path, self.report = path, report
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            report.error(f"{path}: {show(data)} must be a mapping of keys")
            data = {}
        self.data = data
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        self.seen.add(name)  # a key the parser asks about is one it knows (done() does not call it unknown)
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = REQUIRED) -> Any:
        self.seen.add(name)
        value = self.data.get(name)
        if value is not None:
            return value
        if default is REQUIRED:
            self.report.error(f"{self.key(name)}: missing; set it in the config or with {self.key(name)}=...")
            return None
        return default

    def section(self, name: str) -> "Section":
        self.seen.add(name)
        return Section(self.data.get(name), self.key(name), self.report)

    def done(self) -> None:
        """Every key of this mapping was read: anything else is a typo (for sections the stage owns alone)."""
        unknown = sorted(str(k) for k in self.data if k not in self.seen)
        if unknown:
            valid = ", ".join(sorted(self.seen))
            self.report.error(f"{self.key(unknown[0])}: unknown key; {closest(unknown[0], sorted(self.seen))}"
                              f"valid keys here: {valid}")

    def strings(self, name: str) -> tuple[str, ...] | None:
        """A string or a list of strings (a single path is the common case)."""
        value = self.raw(name, ())
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or \
                not all(isinstance(v, str) for v in value):
            self.report.error(f"{self.key(name)}: {show(value)} must be a string or a list of strings")
            return None
        return tuple(value)

    def mapping(self, name: str) -> dict | None:
        value = self.raw(name, None)
        if value is not None and not isinstance(value, Mapping):
            self.report.error(f"{self.key(name)}: {show(value)} must be a mapping")
            return None
        return None if value is None else dict(value)

    def int(self, name: str, default: Any = REQUIRED, minimum: int | None = None, maximum: int | None = None,
            why: str = "") -> int | None:
        value = self.raw(name, default)
        if value is None:
            return None
        # YAML may hand over 2.0 for an integer; accept exact floats, reject 2.5, True and strings.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value):
            self.report.error(f"{self.key(name)}: {show(value)} is not an integer")
            return None
        if abs(value) > INT64_MAX:  # every size and count ends up in a tensor, an index or a C library
            self.report.error(f"{self.key(name)}: {show(value)} does not fit a 64-bit integer (at most {INT64_MAX}); "
                              f"give a real value")
            return None
        if minimum is not None and value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            self.report.error(f"{self.key(name)}: {show(value)} must be {what}")
            return None
        if maximum is not None and value > maximum:
            self.report.error(f"{self.key(name)}: {show(value)} must be at most {maximum}{why}")
            return None
        return int(value)

    def float(self, name: str, default: Any = REQUIRED, minimum: float | None = None,
              above: float | None = None) -> float | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.report.error(f"{self.key(name)}: {show(value)} is not a number")
            return None
        if minimum is not None and value < minimum:
            self.report.error(f"{self.key(name)}: {show(value)} must be >= {minimum}")
            return None
        if above is not None and value <= above:
            self.report.error(f"{self.key(name)}: {show(value)} must be > {above}")
            return None
        return float(value)

    def bool(self, name: str, default: Any = REQUIRED) -> bool | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if not isinstance(value, bool):
            self.report.error(f"{self.key(name)}: {show(value)} is not true or false")
            return None
        return value

    def str(self, name: str, default: Any = REQUIRED) -> str | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            self.report.error(f"{self.key(name)}: {show(value)} must be a string")
            return None
        return str(value)

    def choice(self, name: str, choices: "Choices", default: Any = REQUIRED) -> Any:
        """One of `choices`; another name for the same thing (an alias) is read as its canonical name."""
        self.seen.add(name)
        value = self.data.get(name)
        if value is None:  # absent or null: the default (which may itself be a valid None)
            value = default
        if value is REQUIRED:
            self.report.error(f"{self.key(name)}: missing; valid: {choices.listing()}")
            return None
        message = choices.problem(self.key(name), value)
        if message:
            self.report.error(message)
            return None
        return choices.canonical(value)


class Choices:
    """A closed list of names, with the other spellings NeMo / NxD Training use for the same thing."""

    def __init__(self, names: Sequence[Any], aliases: Mapping[str, Any] | None = None):
        self.names, self.aliases = tuple(names), dict(aliases or {})

    def __iter__(self):
        return iter(self.names)

    def __contains__(self, value: Any) -> bool:
        return value in self.names or (isinstance(value, str) and value in self.aliases)

    def canonical(self, value: Any) -> Any:
        return self.aliases.get(value, value) if isinstance(value, str) else value

    def listing(self) -> str:
        names = ", ".join(show(n) if n is None else str(n) for n in self.names)
        return names + (f" (also accepted: {', '.join(self.aliases)})" if self.aliases else "")

    def problem(self, key: str, value: Any) -> str | None:
        if value in self:
            return None
        hint = closest(value, [str(n) for n in self.names if n is not None] + list(self.aliases)) \
            if isinstance(value, str) else ""
        message = f"{key}: {show(value)} is not one of {self.listing()}"
        return f"{message}; {hint.strip()}" if hint else message
