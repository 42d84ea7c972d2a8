"""Evaluation results: one JSON file for machines, one rich table for people.

A result is a dict {"task", "type", "num_examples", <metric>: float,
<metric>_stderr: float | None, ...}. Every other number in it is shown as a metric, so results from other
sources (a validation-loss pass, say) render the same way.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from runtime.io.files import atomic_write_json

_IDENTITY_KEYS = ("task", "type", "num_examples")


def write_results(results: list[dict[str, Any]], path: str | os.PathLike, *, checkpoint: str | None,
                  step: int | None, settings: str | None = None) -> None:
    """{"checkpoint", "step", "settings", "tasks": results} as JSON, written atomically (readers never see half).
    `settings` identifies the evaluation config the scores came from (runtime/evaluate/__main__.py)."""
    atomic_write_json(path, {"checkpoint": checkpoint, "step": step, "settings": settings, "tasks": results})


def _metrics(result: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """(name, value, stderr) for every numeric entry that is neither an identity key nor a stderr."""
    rows = []
    for key, value in result.items():
        if key in _IDENTITY_KEYS or key.endswith("_stderr"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append((key, float(value), result.get(f"{key}_stderr")))
    return rows


def render_table(results: list[dict[str, Any]]) -> Table:
    """One row per (task, metric), lm-eval style: value and standard error to 4 digits."""
    table = Table(title="Evaluation")
    for column in ("Task", "Type", "N"):
        table.add_column(column)
    table.add_column("Metric")
    table.add_column("Value", justify="right")
    table.add_column("Stderr", justify="right")
    for result in results:
        identity = (str(result.get("task", "")), str(result.get("type", "")), str(result.get("num_examples", "")))
        metrics = _metrics(result)
        if not metrics:
            table.add_row(*identity, "", "", "")
        for name, value, stderr in metrics:
            table.add_row(*identity, name, f"{value:.4f}", "" if stderr is None else f"± {stderr:.4f}")
            identity = ("", "", "")  # the task's name once, on its first metric row
    return table


def print_table(results: list[dict[str, Any]], console: Console | None = None) -> None:
    (console or Console()).print(render_table(results))


def print_user_error(error: Exception) -> None:
    """A user mistake (ValueError, FileNotFoundError, a missing key) as `error: ...` lines on stderr, one per
    problem, as every stage program ends: the evaluation stage and `python -m runtime.sample`."""
    message = f"{error!s}" if not isinstance(error, KeyError) else f"{error.args[0]} is missing"
    for line in getattr(error, "problems", None) or [" ".join(message.split())]:
        print(f"error: {line}", file=sys.stderr, flush=True)
