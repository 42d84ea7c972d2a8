"""What a data_preparation stage will do, computed cheaply: the shard list, the array size, input checks.

The launcher imports this module at render time, on head nodes without torch or tokenizers, so it uses the
standard library only and never touches the network (URLs are checked for shape, not fetched):

    from runtime.data_prep.plan import check_inputs, count_tasks
    errors = check_inputs(stage_cfg)     # [] or one-line messages; report them before submitting anything
    n = count_tasks(stage_cfg)           # the Slurm array is 0..n-1, run.node_array_size of them at once

Array task I of N handles shards I, I+N, I+2N, ... (`shards_for_task`), so any N works; N = one task per shard
unless that passes `max_array_tasks` (Slurm's default MaxArraySize allows 1001 indices).
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from runtime.schema.data_preparation import SYNTHETIC_SOURCES, StageConfig, UserError, parse_config

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Shard:
    """One input file (or URL) and the indexed dataset made from it."""

    index: int
    name: str          # names the outputs: <output_dir>/<name>_text_document.{bin,idx}
    location: str      # a local path, or the URL for source: urls
    is_url: bool = False

    def local_path(self, cfg: StageConfig) -> str:
        """Where the text is read from: the download target for a URL, the file itself otherwise."""
        if self.is_url:
            return os.path.join(cfg.download.dir or "", url_basename(self.location))
        return self.location

    def prefix(self, cfg: StageConfig) -> str:
        return os.path.join(cfg.output_dir, f"{self.name}_text_document")


MAX_FILE_NUMBERS = 100_000  # a range is expanded into a list before anything is read: bound it


def parse_file_numbers(spec: str, key: str = "input.file_numbers") -> list[int]:
    """NeMo-Launcher's syntax: "0,3,5-7" -> [0, 3, 5, 6, 7], in the order given; ranges are inclusive."""
    numbers: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise UserError(f"{key} = {spec!r}: {part!r} is not a number or a range like 5-7")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise UserError(f"{key} = {spec!r}: the range {part!r} runs backwards; write {high}-{low}")
        if len(numbers) + high - low + 1 > MAX_FILE_NUMBERS:
            raise UserError(f"{key} = {spec!r}: names more than {MAX_FILE_NUMBERS} files; list the numbers of the "
                            f"files the job reads (or several jobs' shares)")
        numbers.extend(range(low, high + 1))
    seen: set[int] = set()
    for n in numbers:
        if n in seen:
            raise UserError(f"{key} = {spec!r}: {n} appears twice; list each file number once")
        seen.add(n)
    return numbers


def url_basename(url: str) -> str:
    return os.path.basename(unquote(urlparse(url).path))


def strip_suffix(name: str) -> str | None:
    """'00.jsonl.zst' -> '00'; None when the suffix is not one we read."""
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def _fill_numbers(patterns: tuple[str, ...], spec: str | None, key: str) -> tuple[list[str], bool]:
    """Expands "{...}" placeholders with file_numbers. Returns (entries, whether any placeholder was filled)."""
    templated = [p for p in patterns if "{" in p]
    if templated and spec is None:
        raise UserError(f"{key} = {templated[0]!r} has a {{}} placeholder but input.file_numbers is not set")
    if not templated:
        return list(patterns), False
    numbers = parse_file_numbers(spec)
    entries = []
    for pattern in patterns:
        if "{" not in pattern:
            entries.append(pattern)
            continue
        for n in numbers:
            try:
                entries.append(pattern.format(n))
            except (IndexError, KeyError, ValueError) as err:
                raise UserError(f"{key} = {pattern!r}: cannot fill in file number {n} ({err}); "
                                "use a placeholder like {:02d}") from None
    return entries, True


def _select_by_number(entries: list[str], spec: str | None, key: str) -> list[str]:
    """Without placeholders, file_numbers picks entries of the sorted list by position."""
    if spec is None:
        return entries
    picked = []
    for n in parse_file_numbers(spec):
        if n >= len(entries):
            raise UserError(f"input.file_numbers = {spec!r}: {n} is past the last of the {len(entries)} "
                            f"files that {key} lists (numbers start at 0)")
        picked.append(entries[n])
    return picked


def expand_files(patterns: tuple[str, ...], spec: str | None, key: str, errors: list[str]) -> list[str]:
    """Paths, globs and {}-patterns -> existing files, sorted within each glob; missing ones go to `errors`."""
    entries, filled = _fill_numbers(patterns, spec, key)
    files: list[str] = []
    for i, entry in enumerate(entries):
        entry = os.path.expanduser(entry)
        if _GLOB_CHARS.search(entry):
            matches = sorted(m for m in glob.glob(entry, recursive=True) if os.path.isfile(m))
            if not matches:
                errors.append(f"{key}[{i}] = {entry!r}: the pattern matches no file; fix the path")
            files.extend(matches)
        elif not os.path.isfile(entry):
            errors.append(f"{key}[{i}] = {entry!r}: no such file; fix the path or remove the entry")
        else:
            files.append(entry)
    unique = list(dict.fromkeys(os.path.abspath(f) for f in files))
    return unique if filled else _select_by_number(unique, spec, key)


def build_shards(cfg: StageConfig) -> list[Shard]:
    """The stage's shards, in a fixed order every task agrees on. Raises UserError listing the first problem."""
    errors: list[str] = []
    shards = _build_shards(cfg, errors)
    if errors:
        raise UserError(errors[0] + (f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""))
    return shards


def _build_shards(cfg: StageConfig, errors: list[str]) -> list[Shard]:
    source = cfg.input.source
    if source in SYNTHETIC_SOURCES:
        # One task writes the whole set (runtime.sft.synthetic / runtime.alignment.synthetic write_demo): its
        # splits and tokenizer come from one random stream, so they cannot be split between tasks.
        return [Shard(0, source, cfg.output_dir)]
    if source == "demo":
        raw = os.path.join(cfg.output_dir, "raw")
        return [Shard(i, f"demo_{i:02d}", os.path.join(raw, f"demo_{i:02d}.jsonl"))
                for i in range(cfg.demo.num_shards)]
    if source == "urls":
        entries, filled = _fill_numbers(cfg.input.urls, cfg.input.file_numbers, "input.urls")
        if not filled:
            entries = _select_by_number(entries, cfg.input.file_numbers, "input.urls")
        locations = list(dict.fromkeys(entries))
        for i, url in enumerate(locations):
            if urlparse(url).scheme not in ("http", "https") or not url_basename(url):
                errors.append(f"input.urls[{i}] = {url!r}: expected an http(s) URL that ends in a file name")
    else:
        locations = expand_files(cfg.input.files, cfg.input.file_numbers, "input.files", errors)
    names = []
    for location in locations:
        base = url_basename(location) if source == "urls" else os.path.basename(location)
        stem = strip_suffix(base)
        if stem is None:
            errors.append(f"input.{source} has {location!r}: unsupported file type; expected one of "
                          f"{', '.join(SUFFIXES)}")
        names.append(re.sub(r"[^A-Za-z0-9_.-]", "_", stem or base))
    if len(set(names)) < len(names):
        # Two inputs with the same file name (say */train.jsonl): number them so outputs don't collide.
        names = [f"{i:05d}_{n}" for i, n in enumerate(names)]
    return [Shard(i, n, loc, source == "urls") for i, (n, loc) in enumerate(zip(names, locations))]


def shards_for_task(shards: list[Shard], task_index: int, num_tasks: int) -> list[Shard]:
    return shards[task_index::num_tasks]


def count_tasks(stage_cfg: Mapping[str, Any]) -> int:
    """Array tasks to submit: one per shard, at most `max_array_tasks`. Raises UserError on a bad config."""
    cfg = parse_config(stage_cfg)
    return max(1, min(len(build_shards(cfg)), cfg.max_array_tasks))


def check_inputs(stage_cfg: Mapping[str, Any]) -> list[str]:
    """Every problem the launcher can find before submitting, one line each; [] when the stage can run."""
    try:
        cfg = parse_config(stage_cfg)
    except UserError as err:
        return err.problems
    errors: list[str] = []
    try:
        shards = _build_shards(cfg, errors)
    except UserError as err:
        return errors + err.problems
    tok = cfg.tokenizer
    for key, value in (("model", tok.model), ("vocab_file", tok.vocab_file), ("merge_file", tok.merge_file)):
        if value and not looks_like_url(value) and not os.path.isfile(os.path.expanduser(value)):
            errors.append(f"tokenizer.{key} = {value!r}: no such file; fix the path (URLs are fetched by the job)")
    if tok.train and tok.train.files:
        expand_files(tok.train.files, None, "tokenizer.train.files", errors)
    if isinstance(cfg.download.checksums, str) and not os.path.isfile(cfg.download.checksums):
        errors.append(f"download.checksums = {cfg.download.checksums!r}: no such file; give a sha256sum-style "
                      "file or a {file name: checksum} mapping")
    if cfg.output.blend_weights is not None:
        names = {s.name for s in shards}
        for name in cfg.output.blend_weights:
            if name not in names:
                errors.append(f"output.blend_weights.{name}: no shard has that name; shards are "
                              f"{', '.join(sorted(names)[:10])}")
        missing = sorted(names - set(cfg.output.blend_weights))
        if missing:
            errors.append(f"output.blend_weights has no weight for shard {missing[0]!r}; give every shard one "
                          "(or remove blend_weights to weigh shards by their token counts)")
    return errors


def looks_like_url(value: str) -> bool:
    return urlparse(value).scheme in ("http", "https")
