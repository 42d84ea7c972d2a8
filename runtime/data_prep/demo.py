"""The built-in demo corpus: Python's own standard library sources, so the default run needs no download.

Every machine with Python has these files. Modules are taken in sorted path order until `max_mb` of source
is collected, dealt round-robin to shards, and cut into documents at top-level `def`/`class` statements (so a
document is a module header with its docstring, or one function or class with its docstrings and comments).
The corpus is the same wherever the same Python version runs, which every array task relies on.
"""
from __future__ import annotations

import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from runtime.io.files import atomic_write_bytes

# Large, generated or test-only trees: they would crowd out the ordinary library code.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
              "__pycache__", "ensurepip", "pydoc_data", "encodings"}
# A blank line, then a top-level statement that starts a definition (decorators stay with their function).
_TOP_LEVEL = re.compile(r"\n\s*\n(?=(?:async\s+def|def|class)\s|@)")


def stdlib_files(max_bytes: int) -> list[Path]:
    """Sorted standard library .py files, in order, until their sizes add up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    chosen, total = [], 0
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        if total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def documents(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    for piece in _TOP_LEVEL.split(text):
        if piece.strip():
            yield piece.strip("\n") + "\n"


def write_demo_shard(dest: str | os.PathLike, shard_index: int, num_shards: int, max_mb: float,
                     text_key: str = "text") -> None:
    """Writes shard `shard_index` of the demo corpus as JSON lines (atomically; identical from any task)."""
    if Path(dest).exists():
        return
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for i, path in enumerate(stdlib_files(int(max_mb * 1e6))):
        if i % num_shards != shard_index:
            continue
        source = path.relative_to(root).as_posix()
        lines.extend(json.dumps({text_key: doc, "source": source}) + "\n" for doc in documents(path))
    atomic_write_bytes(dest, "".join(lines).encode("utf-8"))
