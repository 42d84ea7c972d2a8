"""The interpolations of a plain composed config (launcher/plain_compose.py) resolved as OmegaConf resolves them,
without importing it, for the forms conf/ uses:

- `${a.b}` from the root, `${.b}` / `${..b}` from the node's own mapping and up;
- `${name:arg,...}` for the resolvers of launcher/resolvers.py that the launch cache may store (multiply,
  divide_ceil, divide_floor, cwd, trained, trained_here, shared_dir), their arguments words, numbers, true/false/null or
  interpolations;
- a value that is one interpolation keeps the type of what it names; text around interpolations makes a string
  (each part as str() writes it).

Anything else (another resolver, an escape, a quoted argument, an interpolation of a mapping or a list, a key that
is missing, a cycle) raises Unsupported, and the caller resolves with OmegaConf (compose.resolve), which names the
mistake."""

from __future__ import annotations

import re
from typing import Any

from launcher.plain_compose import NAME, Unsupported, scalar

NODE = re.compile(rf"(\.*)({NAME}(?:\.{NAME})*)")
CALL = re.compile(rf"({NAME}(?:\.{NAME})*):(.*)", re.S)
WHOLE = re.compile(r"\$\{(?:[^${}]|\$\{[^${}]*\})*\}")
ARGUMENT_TOKEN = re.compile(r"\$\{(?:[^${}]|\$\{[^${}]*\})*\}|,|[^,$]+|\$")   # an interpolation, a comma, other text
MAX_DEPTH = 64   # deeper chains of interpolations are left to OmegaConf (and a cycle is one)


def _pieces(text: str) -> list:
    """The text's literal parts (str) and interpolations (a one-element tuple of what is inside `${...}`)."""
    pieces: list = []
    at = 0
    while (start := text.find("${", at)) >= 0:
        pieces.append(text[at:start])
        depth, end = 0, start
        while end < len(text):
            if text.startswith("${", end):
                depth, end = depth + 1, end + 2
                continue
            depth -= text[end] == "}"
            end += 1
            if depth == 0:
                break
        if depth:
            raise Unsupported(text)
        pieces.append((text[start + 2:end - 1],))
        at = end
    pieces.append(text[at:])
    if any(set(p) & set("\\${}") for p in pieces if isinstance(p, str)):
        raise Unsupported(text)
    return [p for p in pieces if p != ""]


def _arguments(text: str) -> list[str]:
    """A resolver's arguments, split at the commas outside interpolations, each stripped of blanks."""
    if not text.strip():
        return []
    parts = [""]
    for token in ARGUMENT_TOKEN.findall(text):
        if token == ",":
            parts.append("")
        else:
            parts[-1] += token
    return [part.strip(" \t") for part in parts]


class Resolver:
    """Resolves `cfg`'s values. `tokens`: placeholders (launcher/placeholders.py); `handed` names each resolver
    that was given an argument holding one."""

    def __init__(self, cfg: dict, tokens: tuple[str, ...] = ()):
        from launcher.resolvers import FUNCTIONS

        self.cfg, self.tokens, self.handed = cfg, tokens, []
        self.functions = {**FUNCTIONS, "trained": self._trained(False), "trained_here": self._trained(True),
                          "shared_dir": self._shared_dir}
        self.depth = 0

    def container(self) -> dict:
        """The whole config, every interpolation expanded (compose.resolve of the same config)."""
        return self._resolved(self.cfg, [])

    def _resolved(self, value: Any, chain: list) -> Any:
        if isinstance(value, dict):
            return {key: self._resolved(item, [*chain, value]) for key, item in value.items()}
        if isinstance(value, list):
            return [self._resolved(item, [*chain, value]) for item in value]
        return self.value(value, chain)

    def select(self, key: str) -> Any:
        """The resolved value at a dotted key from the root."""
        raw, chain = self._node(key.split("."), [self.cfg])
        return self.value(raw, chain)

    def value(self, raw: Any, chain: list) -> Any:
        """`raw`, a leaf whose mappings from the root down are `chain`, resolved."""
        if not isinstance(raw, str) or "${" not in raw:
            return raw
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise Unsupported(raw)
            pieces = _pieces(raw)
            if len(pieces) == 1 and isinstance(pieces[0], tuple):
                return self._interpolation(pieces[0][0], chain)
            return "".join(p if isinstance(p, str) else str(self._interpolation(p[0], chain)) for p in pieces)
        finally:
            self.depth -= 1

    def _node(self, parts: list[str], chain: list) -> tuple[Any, list]:
        """The raw value at `parts` below chain[-1], and the mappings from the root down to it."""
        chain = list(chain)
        for depth, part in enumerate(parts):
            node = chain[-1]
            if not isinstance(node, dict) or part not in node:
                raise Unsupported(".".join(parts))  # OmegaConf names the missing key
            if depth < len(parts) - 1:
                chain.append(node[part])
        raw = chain[-1][parts[-1]]
        if isinstance(raw, (dict, list)):
            raise Unsupported(".".join(parts))   # an interpolation of a mapping or a list
        return raw, chain

    def _interpolation(self, inside: str, chain: list) -> Any:
        if found := NODE.fullmatch(inside):
            dots, key = found.groups()
            if not dots:
                raw, where = self._node(key.split("."), [self.cfg])
            else:
                if len(dots) > len(chain) or not all(isinstance(c, dict) for c in chain[len(chain) - len(dots):]):
                    raise Unsupported(inside)
                raw, where = self._node(key.split("."), chain[:len(chain) - len(dots) + 1])
            return self.value(raw, where)
        if found := CALL.fullmatch(inside):
            name, text = found.groups()
            if name not in self.functions:
                raise Unsupported(name)
            args = [self._argument(arg, chain) for arg in _arguments(text)]
            if any(t in (a if isinstance(a, str) else repr(a)) for a in args for t in self.tokens):
                self.handed.append(name)
            try:
                return self.functions[name](*args)
            except Exception:  # a resolver's error is OmegaConf's to report, with its key
                raise Unsupported(name) from None
        raise Unsupported(inside)

    def _argument(self, text: str, chain: list) -> Any:
        if WHOLE.fullmatch(text):
            return self._interpolation(text[2:-1], chain)
        return scalar(text)

    def _trained(self, here: bool):
        from launcher.resolvers import trained_key

        def read(key: str) -> Any:
            stages = self.cfg.get("stages")
            if isinstance(stages, list):
                stages = [self.value(stage, [self.cfg, stages]) for stage in stages]
            elif isinstance(stages, str) and "${" in stages:
                raise Unsupported("stages")
            path = trained_key(stages, self.cfg, key, here)
            return None if path is None else self.select(path)

        return read


    def _shared_dir(self, name: Any) -> str:
        from launcher.resolvers import shared_dir

        def at(key: str) -> Any:
            node: Any = self.cfg
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    return None
                node = node[part]
            return self.select(key) if isinstance(node, str) else node

        return shared_dir(str(name), at("cluster_type"), at("cluster.k8s.volume.mount_path"))


def resolve(cfg: dict) -> dict:
    """compose.resolve for a plain composed config, or Unsupported."""
    return Resolver(cfg).container()


class PlainNodes:
    """A plain composed config, as launcher/placeholders.py's `place` and `resolve_placed` read and set it."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg

    def _parent(self, key: str) -> tuple[dict | None, str]:
        *parents, leaf = key.split(".")
        node: Any = self.cfg
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
            if isinstance(node, str) and "${" in node:
                raise Unsupported(key)  # OmegaConf would look through the interpolation
        return (node if isinstance(node, dict) else None), leaf

    def raw(self, key: str) -> Any:
        from launcher.placeholders import ABSENT

        parent, leaf = self._parent(key)
        return parent[leaf] if parent is not None and leaf in parent else ABSENT

    def set(self, key: str, value: str) -> None:
        parent, leaf = self._parent(key)
        parent[leaf] = value

    def select(self, key: str) -> Any:
        return Resolver(self.cfg).select(key)

    def resolve_watching(self, tokens: list[str]) -> tuple[dict, list[str]]:
        resolver = Resolver(self.cfg, tuple(tokens))
        return resolver.container(), resolver.handed
