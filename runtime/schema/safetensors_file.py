# Is a .safetensors file whole? Read from its header alone, with the standard library only: the launcher runs this
# at launch (without torch or safetensors installed) so that a truncated download or a zeroed header is one line
# naming the file before anything is queued, instead of safetensors' "incomplete metadata" traceback in the worker.
#
# The format: 8 bytes, the header's length n as a little-endian u64; n bytes of UTF-8 JSON {name: {dtype, shape,
# data_offsets: [begin, end]}, "__metadata__": {str: str}}; then the data, whose byte ranges are the offsets,
# relative to the data's start. The checks are the ones safetensors itself makes when it opens a file.
from __future__ import annotations

import json
import math
import os
from pathlib import Path

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a longer header
MAX_PROBLEMS = 3                # a directory's first few problems: the rest are usually the same one again

# Bits per element of each safetensors dtype (the sub-byte float formats pack several elements per byte).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
              "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# What a Hugging Face directory may hold its weights as, in the order a reader looks for them.
WEIGHT_FILES = (SINGLE, INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """None when `path` is a well-formed safetensors file, else one line naming it and what is wrong."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            prefix = file.read(8)
            if len(prefix) < 8:
                return f"{path}: not a safetensors file: it holds {size} bytes, fewer than the 8 of its header length"
            length = int.from_bytes(prefix, "little")
            if length == 0:
                return f"{path}: not a safetensors file: header length 0 (its first 8 bytes are zero)"
            if length > MAX_HEADER_BYTES:
                return (f"{path}: not a safetensors file: header length {length} is over safetensors' limit of "
                        f"{MAX_HEADER_BYTES} bytes")
            if 8 + length > size:
                return f"{path}: truncated: its header needs {8 + length} bytes but it holds {size}"
            text = file.read(length)
    except OSError as error:
        return f"{path}: cannot be read ({error.strerror or error})"
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{path}: not a safetensors file: its header is not valid JSON ({error})"
    if not isinstance(header, dict):
        return f"{path}: not a safetensors file: its header is not a JSON object"
    return _tensors_problem(path, header, size - 8 - length)


def _tensors_problem(path: str | os.PathLike, header: dict, data_bytes: int) -> str | None:
    """The header's entries against each other and against the data that follows it."""
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return f"{path}: not a safetensors file: its __metadata__ is not a mapping of strings"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            return f"{where}: {entry!r} is not a mapping with dtype, shape and data_offsets"
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BITS:
            return f"{where}: dtype {dtype!r} is not a safetensors dtype ({', '.join(DTYPE_BITS)})"
        if not isinstance(shape, list) or not all(_natural(n) for n in shape):
            return f"{where}: shape {shape!r} is not a list of non-negative integers"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(n) for n in offsets)
                and offsets[0] <= offsets[1]):
            return f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end"
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            return (f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but shape {shape} of "
                    f"{dtype} needs {bits / 8:g}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):  # safetensors wants the data packed: each tensor where the last ended
        if begin != end:
            expected = "0, the data's start" if end == 0 else f"{end}, where the previous tensor's data ends"
            return f"{path}: tensor {name!r}: its data_offsets begin at {begin}, not at {expected}"
        end = stop
    if end > data_bytes:
        return f"{path}: truncated: its tensors need {end} bytes of data but it holds {data_bytes}"
    if end < data_bytes:
        return f"{path}: not a safetensors file: {data_bytes - end} bytes after its last tensor's data"
    return None


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def hf_weights_problems(directory: str | os.PathLike) -> list[str]:
    """The first few problems of a Hugging Face directory's safetensors weights (model.safetensors, or the shards
    model.safetensors.index.json names), one line each, or that it has no weight file at all; [] when they are
    whole or are the older pytorch_model.bin weights (not checked here)."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        return [f"{directory} has no weights: expected {', '.join(WEIGHT_FILES[:-1])} or {WEIGHT_FILES[-1]}"]
    if (directory / SINGLE).is_file():
        problem = safetensors_problem(directory / SINGLE)
        return [problem] if problem else []
    index = directory / INDEX
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        return [f"{index}: not a safetensors index: not a JSON object ({error})"]
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        return [f"{index}: not a safetensors index: no weight_map of tensor names to shard files"]
    problems = []
    for shard in sorted(set(weight_map.values())):
        if "/" in shard or shard in ("", ".", ".."):  # a shard lives next to its index, never elsewhere
            problems.append(f"{index} names {shard!r} as a shard, which is not a file name in {directory}")
        elif not (directory / shard).is_file():
            problems.append(f"{index} names {shard}, which is not in {directory}")
        elif problem := safetensors_problem(directory / shard):
            problems.append(problem)
    if len(problems) > MAX_PROBLEMS:
        return problems[:MAX_PROBLEMS - 1] + [f"{problems[MAX_PROBLEMS - 1]} (and {len(problems) - MAX_PROBLEMS} "
                                              f"more missing or damaged shards)"]
    return problems


def tensor_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a Hugging Face directory's safetensors weights, from the headers alone: call it once
    hf_weights_problems found them whole. {} for the older pytorch_model.bin weights."""
    directory = Path(directory)
    if (directory / SINGLE).is_file():
        files = [directory / SINGLE]
    elif (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text(encoding="utf-8"))["weight_map"]
        files = [directory / shard for shard in sorted(set(weight_map.values()))]
    else:
        return {}
    shapes = {}
    for path in files:
        with open(path, "rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")).decode("utf-8"))
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes
