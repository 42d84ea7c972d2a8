# model.data.data_prefix, the one parser: a [w1, p1, w2, p2, ...] list, [p1], the path of a blend file
# (Megatron-DeepSpeed's DATA_FILE_LIST: `weight prefix [corpus]` per line), or one dataset prefix.
# Standard library only: the launcher checks data paths with it before submitting, the data loader reads with it.
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

KEY = "training.model.data.data_prefix"


class MissingDataPrefix(ValueError):
    """A data_prefix string that is neither a blend file nor a dataset prefix here: a file problem (a warning in a
    dry run, which may render for a cluster whose file system it cannot see), not a malformed value."""


@dataclass(frozen=True)
class BlendEntry:
    weight: float
    prefix: str


def _check_weight(value, where: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: weight {value!r} is not a number") from None
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{where}: weight {value!r} must be a number >= 0")
    return weight


def _drop_zero_weights(entries: list[BlendEntry], source: str, key: str) -> list[BlendEntry]:
    """A weight of 0 (an empty shard in a token-count blend) contributes nothing; at least one must remain."""
    kept = [e for e in entries if e.weight > 0]
    if not kept:
        raise ValueError(f"{key}: {source}: every weight is 0, so there is nothing to train on")
    return kept


def map_blend_prefixes(text: str, change) -> tuple[str, list[str]]:
    """A blend file's text with each entry's prefix replaced by change(prefix) (None keeps it), comments, blank
    lines and the weight and corpus fields kept as they are; and the prefixes as they were. The one reading of
    the line format besides read_blend_file, for code that moves blend files (S3 staging)."""
    lines, prefixes = [], []
    for line in text.splitlines():
        content, hash_, comment = line.partition("#")
        fields = content.split()
        if len(fields) in (2, 3):
            prefixes.append(fields[1])
            new = change(fields[1])
            if new is not None and new != fields[1]:
                fields[1] = new
                line = " ".join(fields) + (f" {hash_}{comment}" if hash_ else "")
        lines.append(line)
    return "\n".join(lines) + "\n", prefixes


def read_blend_file(path: str | os.PathLike, key: str = KEY) -> list[BlendEntry]:
    """`weight prefix [corpus]` per line, `#` comments. A relative prefix is resolved against the blend file's
    own directory, so a data directory can be moved or mounted elsewhere as a whole."""
    path = Path(path)
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{key}: blend file {path} line {number}"
        if len(fields) not in (2, 3):
            raise ValueError(f"{where}: {raw.strip()!r} is not 'weight prefix [corpus]'")
        prefix = fields[1] if os.path.isabs(fields[1]) else str(path.parent / fields[1])
        entries.append(BlendEntry(_check_weight(fields[0], where), prefix))
    if not entries:
        raise ValueError(f"{key}: blend file {path} lists no datasets")
    return _drop_zero_weights(entries, f"blend file {path}", key)


def parse_list(data_prefix, key: str = KEY) -> list[BlendEntry]:
    """The list forms, without touching the file system."""
    if isinstance(data_prefix, Sequence) and len(data_prefix) == 1 and isinstance(data_prefix[0], str):
        return [BlendEntry(1.0, data_prefix[0])]
    if isinstance(data_prefix, (str, bytes)) or not isinstance(data_prefix, Sequence) or not data_prefix \
            or len(data_prefix) % 2:
        raise ValueError(f"{key}: {data_prefix!r} is invalid; expected [weight1, prefix1, weight2, prefix2, ...], "
                         f"a dataset prefix or the path of a blend file")
    entries = []
    for i in range(0, len(data_prefix), 2):
        weight, prefix = data_prefix[i], data_prefix[i + 1]
        if not isinstance(prefix, str):
            raise ValueError(f"{key}[{i + 1}]: {prefix!r} is not a dataset prefix (a path)")
        entries.append(BlendEntry(_check_weight(weight, f"{key}[{i}]"), prefix))
    return _drop_zero_weights(entries, "list", key)


def parse_data_prefix(data_prefix, key: str = KEY) -> list[BlendEntry]:
    """model.data.data_prefix -> weighted prefixes. A string is a blend file if it is a file (other than a .bin or
    .idx), else a dataset prefix whose .idx exists; ValueError names which when it is neither."""
    if isinstance(data_prefix, (str, os.PathLike)):
        path = Path(data_prefix)
        if path.is_file() and path.suffix not in (".bin", ".idx"):
            return read_blend_file(path, key)
        if Path(f"{data_prefix}.idx").is_file():
            return [BlendEntry(1.0, str(data_prefix))]
        raise MissingDataPrefix(f"{key}: {str(data_prefix)!r} is neither a blend file nor a dataset prefix "
                         f"(no {data_prefix}.idx); run the data_preparation stage first or point it at its output")
    return parse_list(data_prefix, key)


def missing_datasets(entries: list[BlendEntry], key: str = KEY) -> list[str]:
    """One line per dataset whose .idx or .bin is not there; one line in all when more than three are missing."""
    lines = []
    for entry in entries:
        missing = [entry.prefix + s for s in (".idx", ".bin") if not Path(entry.prefix + s).is_file()]
        if missing:
            lines.append(f"{key}: dataset {entry.prefix} has no {' or '.join(missing)}")
    if len(lines) > 3:
        first = lines[0].split(": ", 1)[1]
        return [f"{key}: {len(lines)} of {len(entries)} datasets are missing (the first: {first})"]
    return lines
