"""The lm-eval tasks an evaluation config names, found and checked before any model loads (and at launch, where
lm-eval is installed), and the task files this repository ships for the local task types.

Imports neither torch nor the runtime's model side: the launcher calls `problems()` on its host.

    evaluation.tasks: [hellaswag, arc_easy, my_task]      lm-eval task, group or tag names
    evaluation.include_path: /fsx/eval/tasks               a folder of your own task YAML files (--include_path)

Names are looked up among your include_path's tasks first and lm-eval's own only when needed (indexing lm-eval's
~15,000 task files takes seconds). Nothing is downloaded: Hugging Face datasets run offline (HF_DATASETS_OFFLINE,
HF_HUB_OFFLINE, unless the environment sets them), reading local data files or the datasets cache
(evaluation.datasets_cache, else HF_DATASETS_CACHE or ~/.cache/huggingface/datasets).

The local types (`{name, type: multiple_choice | last_word | perplexity | synthetic_demo, path}`) are lm-eval tasks
too: the stage checks the file (runtime/evaluate/tasks.py), writes it normalized beside the results and runs the
matching file of task_files/ on it.
"""
from __future__ import annotations

import difflib
import functools
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

TASK_FILES = Path(__file__).with_name("task_files")
LOCAL_TYPES = {"multiple_choice": "multiple_choice.yaml", "synthetic_demo": "multiple_choice.yaml",
               "last_word": "last_word.yaml", "perplexity": "perplexity.yaml"}
# datasets' builders for local files: the rest of dataset_path values name a Hub dataset (or a local directory).
_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def offline(datasets_cache: str | None) -> None:
    """Before datasets is imported: never reach for the Hub (a node without internet would wait on it), and read
    the datasets cache the config names."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if datasets_cache:
        os.environ["HF_DATASETS_CACHE"] = datasets_cache


def datasets_cache_dir(datasets_cache: str | None = None) -> str:
    return datasets_cache or os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "datasets")


def cached_dataset(dataset: str, datasets_cache: str | None = None) -> str:
    """Where the datasets library keeps a Hub dataset it has read (namespace___name under the cache)."""
    return os.path.join(datasets_cache_dir(datasets_cache), dataset.replace("/", "___"))


def local_task(name: str, kind: str, data_file: str | os.PathLike) -> dict[str, Any]:
    """The shipped task file for a local type, as an lm-eval task config for one normalized data file."""
    config = yaml.safe_load((TASK_FILES / LOCAL_TYPES[kind]).read_text())
    config["task"] = name
    config["dataset_kwargs"] = {"data_files": {"test": str(data_file)}}
    return config


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None, *, defaults: bool):
    """lm-eval's index of task files (lm-eval's own ~15,000 take seconds: built once per process and folder)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


@dataclass(frozen=True)
class Entry:
    """What the checks read of one lm-eval index entry (a task, group or tag)."""
    cfg: dict[str, Any] | None   # group/task members, dataset_path, dataset_kwargs.data_files: what _missing_data reads
    tags: tuple[str, ...]
    yaml_path: str | None


class Catalog:
    """The part of lm-eval's task index the name and data checks read, small enough to store as JSON: the launcher
    keeps lm-eval's own in its cache (launcher/cache.py lm_eval_catalog), since indexing its ~15,000 task files
    costs ~20 s of CPU on a small host and reading the stored catalog milliseconds."""

    def __init__(self, entries: dict[str, dict[str, Any]]):
        self.entries = entries
        self.task_index = {name: Entry(e["cfg"], tuple(e["tags"]), e["yaml_path"]) for name, e in entries.items()}
        self.all_tasks = sorted(self.task_index)

    @classmethod
    def of(cls, manager) -> Catalog:
        return cls({name: {"cfg": _checked_part(entry.cfg), "tags": sorted(entry.tags or ()),
                           "yaml_path": None if entry.yaml_path is None else str(entry.yaml_path)}
                    for name, entry in manager.task_index.items()})

    def updated(self, other: Catalog) -> Catalog:
        """This catalog with `other`'s entries over its own (an include_path over lm-eval's own tasks)."""
        return Catalog({**self.entries, **other.entries})


def _checked_part(cfg: dict[str, Any] | None) -> dict[str, Any] | None:
    if cfg is None:
        return None
    part = {k: cfg[k] for k in ("group", "dataset_path") if isinstance(cfg.get(k), (str, type(None))) and k in cfg}
    if isinstance(cfg.get("task"), list):
        part["task"] = [t for t in cfg["task"] if isinstance(t, str)]
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg.get("dataset_kwargs"), dict) else None
    if files is not None:
        part["dataset_kwargs"] = {"data_files": json.loads(json.dumps(files, default=str))}
    return part


def own_tasks_stamp() -> dict[str, Any]:
    """What identifies lm-eval's own task files here (its version, where they are, when they were installed)."""
    import importlib.metadata
    import importlib.util

    origin = Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks"
    return {"lm_eval": importlib.metadata.version("lm_eval"), "tasks": str(origin), "mtime": origin.stat().st_mtime_ns}


def resolve(names: list[str], include_path: str | None, datasets_cache: str | None = None,
            key: str = "evaluation.", own: Callable[[], Catalog] | None = None) -> tuple[Any, list[str], list[str]]:
    """(an lm-eval TaskManager that knows every name, one line per problem with the names, one per missing input):
    a name that is no task, group or tag (with its close matches) or an include_path that is no folder; a task
    whose local data file is not there or whose Hub dataset is not in the datasets cache. With `own` (what gives
    lm-eval's own tasks as a stored Catalog, asked only when an include_path does not hold every name), the names are checked against catalogs and a Catalog is returned in the manager's
    place: what a launch checks, not what a node runs."""
    if include_path is not None and not Path(include_path).is_dir():  # nothing to look the names up in here
        return None, [], [f"{key}include_path: {include_path!r} is not a directory; point it at a folder of lm-eval "
                          f"task YAML files"]
    if not names:
        return None, [], []
    manager = task_manager(include_path, defaults=False) if include_path else None
    if manager is None or not all(_known_closure(manager, name) for name in names):
        if own is not None:
            manager = own() if manager is None else own().updated(Catalog.of(manager))
        else:
            manager = task_manager(include_path, defaults=True)
    errors, missing = [], []
    for name in names:
        if name in manager.task_index:
            for line in _missing_data(manager, name, datasets_cache, key):
                if line not in missing:  # a group's tasks often share one dataset: one line for it
                    missing.append(line)
            continue
        close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
        hint = f"close matches: {', '.join(close)}" if close else "`lm-eval ls tasks` lists them"
        errors.append(f"{key}tasks: {name!r} is not an lm-eval task, group or tag ({hint}); your own task YAML files "
                      f"go in a folder named by {key}include_path")
    return manager, errors, missing


def _children(manager, name: str) -> list[str]:
    entry = manager.task_index.get(name)
    if entry is None or entry.cfg is None:
        return sorted(getattr(entry, "tags", None) or ()) if entry is not None else []
    tasks = entry.cfg.get("task") if "group" in entry.cfg else None
    return [t for t in (tasks or []) if isinstance(t, str)]


def _known_closure(manager, name: str, seen: set[str] | None = None) -> bool:
    seen = set() if seen is None else seen
    if name in seen:
        return True
    seen.add(name)
    return name in manager.task_index and all(_known_closure(manager, c, seen) for c in _children(manager, name))


def _missing_data(manager, name: str, datasets_cache: str | None, key: str, top: str | None = None,
                  seen: set[str] | None = None) -> list[str]:
    """The data a task (or every task of a group, named by the group: `top`) reads that is not there: a local
    data file, or a Hub dataset the datasets cache does not hold."""
    top = top or name
    seen = set() if seen is None else seen
    if name in seen:
        return []
    seen.add(name)
    entry = manager.task_index[name]
    errors = []
    for child in _children(manager, name):
        if child in manager.task_index:
            errors += _missing_data(manager, child, datasets_cache, key, top, seen)
    cfg = entry.cfg or {}
    dataset = cfg.get("dataset_path")
    if "group" in cfg or not isinstance(dataset, str):
        return errors
    if dataset not in _FILE_BUILDERS:
        if not Path(dataset).exists() and not Path(cached_dataset(dataset, datasets_cache)).exists():
            errors.append(dataset_missing(top, dataset, None, key, datasets_cache))
        return errors
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    listed = files.values() if isinstance(files, dict) else [files]
    for item in listed:
        for path in [item] if isinstance(item, (str, os.PathLike)) else list(item or []):
            path = str(path)
            if "://" in path or glob.has_magic(path) or Path(path).exists():
                continue
            errors.append(f"{key}tasks: {top}: its data file {path} does not exist (task file {entry.yaml_path}); "
                          f"copy the data there or fix the task's dataset_kwargs.data_files")
    return errors


def dataset_missing(name: str, dataset: str | None, error: BaseException | None, key: str = "evaluation.",
                    datasets_cache: str | None = None) -> str:
    """The one line for a task whose data is not here (not in the cache; or raised by datasets, reading offline,
    while lm-eval built the task)."""
    if isinstance(error, FileNotFoundError) and dataset in _FILE_BUILDERS:
        return f"{key}tasks: {name}: {error}; copy the data there or fix the task's dataset_kwargs.data_files"
    where = cached_dataset(str(dataset), datasets_cache)
    return (f"{key}tasks: {name}: its dataset {dataset!r} is not in the local datasets cache (looked for {where}); "
            f"copy it there from a machine that can reach the Hugging Face Hub ({key}datasets_cache names the cache), "
            f"or give a task YAML with local data_files in {key}include_path")
