# What a search leaves behind: a CSV of every trial sorted by measured throughput, the best layout as a training
# config that nxdt-launch takes back as `training=autoconfig/<name>`, and the tables printed at the end.
from __future__ import annotations

import csv
from datetime import datetime, timezone
from pathlib import Path

from launcher.autoconfig.runner import Measurement
from launcher.autoconfig.search import Ranked

COLUMNS = ("rank", "run_name", "status", "reason", "tp", "pp", "vpp", "cp", "micro_batch_size", "recompute",
           "sequence_parallel", "zero_stage", "shard_degree", "tokens_per_s", "step_time_s", "tflops_per_device",
           "memory_gib", "steps_measured", "estimated_step_time_s", "estimated_memory_gib")


def ordered(measurements: list[Measurement]) -> list[Measurement]:
    """Successful trials by measured tokens/s, highest first (as numbers); failed ones after, as launched."""
    good = sorted((m for m in measurements if m.ok), key=lambda m: -(m.tokens_per_s or 0.0))
    return good + [m for m in measurements if not m.ok]


def _number(value: float | None, digits: int = 6) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def write_csv(path: Path, measurements: list[Measurement]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for rank, m in enumerate(ordered(measurements), start=1):
            c, est = m.trial.ranked.candidate, m.trial.ranked.estimate
            writer.writerow([
                rank if m.ok else "", m.trial.run_name, "ok" if m.ok else "failed", m.reason, c.tp, c.pp,
                c.vpp or "", c.cp, c.micro_batch_size, c.recompute or "none", c.sequence_parallel, c.zero_stage,
                c.shard_degree or "", _number(m.tokens_per_s), _number(m.step_time_s), _number(m.tflops_per_device),
                _number(m.memory_gib), m.steps, _number(est.step.total_s if est else None),
                _number(est.memory.total / 2**30 if est else None),
            ])
    return path


def best_config_text(training_yaml: str, *, name: str, best: Measurement, tried: int, conf_root: Path,
                     command: str) -> str:
    """The winning layout's full training config (interpolations kept), with how it was chosen and how to use it."""
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    c = best.trial.ranked.candidate
    shard = f" (shard groups of {c.shard_degree})" if c.shard_degree else ""
    header = [
        f"# The fastest layout of {tried} measured by `{command}` ({when}):",
        f"# tp {c.tp}, pp {c.pp}, virtual pp {c.vpp or '-'}, cp {c.cp}, micro-batch {c.micro_batch_size}, recompute "
        f"{c.recompute or 'none'}, ZeRO stage {c.zero_stage}{shard}: {best.tokens_per_s:,.0f} tokens/s, "
        f"{best.step_time_s:.4g} s/step, "
        f"{(best.tflops_per_device or 0):.4g} TFLOP/s per device, {(best.memory_gib or 0):.3g} GiB peak.",
        "# The full run (max_steps from the search's token budget). Train it with:",
        f"#   nxdt-launch hydra.searchpath=[file://{conf_root}] training=autoconfig/{name}",
        "# plus the launch overrides the search used (cluster, data_dir, ...).",
    ]
    return "\n".join(header) + "\n" + training_yaml


def candidates_table(ranked: list[Ranked], limit: int, title: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("#", "tp", "pp", "vpp", "cp", "mbs", "recompute", "SP", "ZeRO/shard", "est. GiB/device", "est. step", "note"):
        table.add_column(column, justify="right" if column not in ("recompute", "note") else "left")
    for index, item in enumerate(ranked[:limit], start=1):
        c, est = item.candidate, item.estimate
        table.add_row(str(index), str(c.tp), str(c.pp), str(c.vpp or "-"), str(c.cp), str(c.micro_batch_size),
                      c.recompute or "none", "on" if c.sequence_parallel else "off",
                      f"{c.zero_stage}/{c.shard_degree}" if c.shard_degree else str(c.zero_stage),
                      f"{est.memory.total / 2**30:.2f}" if est else "-",
                      f"{est.step.total_s:.4g} s" if est else "-", item.rejected or "")
    return table


def results_table(measurements: list[Measurement], top_n: int, title: str):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("rank", "run", "tokens/s", "s/step", "TFLOP/s/device", "GiB", "est. s/step", "status"):
        table.add_column(column, justify="left" if column in ("run", "status") else "right")
    shown = [m for m in ordered(measurements) if m.ok][:top_n] + [m for m in measurements if not m.ok]
    for rank, m in enumerate(shown, start=1):
        est = m.trial.ranked.estimate
        table.add_row(str(rank) if m.ok else "-", m.trial.run_name, _number(m.tokens_per_s, 5),
                      _number(m.step_time_s, 4), _number(m.tflops_per_device, 4), _number(m.memory_gib, 3),
                      _number(est.step.total_s if est else None, 4),
                      "ok" if m.ok else f"[red]failed[/]: {escape(m.reason)}")
    return table
