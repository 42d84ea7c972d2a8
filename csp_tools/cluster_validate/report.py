# The report: cluster_validation.json (every check and every measured row), the override that keeps the bad
# nodes out of later launches, and its two renderings: nccl-tests text tables for the job log, rich tables for
# the terminal. Torch-free: the CLI prints a report a job wrote on another node.
from __future__ import annotations

import json
from pathlib import Path

from csp_tools.cluster_validate.bandwidth import Row, format_table

REPORT_FILE = "cluster_validation.json"
EXCLUDE_FILE = "exclude_override.txt"
PAIR_PHASES = ("pair", "bisect", "pair recheck", "bisect recheck")  # tests shown as one busbw line each
_STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}


def exclude_override(bad_nodes: list[str], already_excluded: tuple[str, ...] = ()) -> str:
    """The Hydra override a later launch takes; the launcher renders it as `#SBATCH --exclude=...`."""
    nodes = list(dict.fromkeys([*already_excluded, *sorted(bad_nodes)]))
    return f"cluster.exclude=[{','.join(nodes)}]"


def common_failures(health: dict[str, list[dict]]) -> list[str]:
    """'check: detail' for every health check that fails on every node. That is a configuration mistake (a
    data_dir missing everywhere, a wrong instance type), which excluding nodes cannot fix."""
    failing = [{c["name"]: c["detail"] for c in checks if c["status"] == "fail"} for checks in health.values()]
    if not failing:
        return []
    shared = set.intersection(*(set(f) for f in failing))
    return [f"{name}: {failing[0][name]}" for name in sorted(shared)]


def write(report: dict, results_dir: str | Path) -> Path:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / REPORT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)  # readers on other nodes never see half a report
    (results_dir / EXCLUDE_FILE).write_text(report["exclude_override"] + "\n")
    return path


def load(results_dir: str | Path) -> dict:
    return json.loads((Path(results_dir) / REPORT_FILE).read_text())


def test_title(test: dict) -> str:
    group = ",".join(test["group"])
    return f"{test['phase']} · {group} · {test['ranks']} ranks · {test['backend']} · {test['source']}"


def test_text(test: dict) -> str:
    """One test in the nccl-tests layout: a table per operation, then its errors."""
    by_op: dict[str, list[Row]] = {}
    for row in test["rows"]:
        by_op.setdefault(row["operation"], []).append(Row.from_json(row))
    out = [format_table(rows, f"{op} · {test_title(test)}") for op, rows in by_op.items()]
    out += [f"# {test_title(test)}: error: {error}" for error in test["errors"]]
    return "\n".join(out) or f"# {test_title(test)}: no rows"


def verdict_text(report: dict) -> str:
    out = []
    for name, verdict in report["verdicts"].items():
        state = "PASS" if verdict["passed"] else "FAIL"
        out.append(f"{state} {name}" + (f": {'; '.join(verdict['reasons'])}" if verdict["reasons"] else ""))
        out += [f"  {name}: {why}" for why in verdict.get("transient", [])]
    out += [f"note: {note}" for note in report.get("notes", [])]
    out.append(f"exclude override: {report['exclude_override']}")
    return "\n".join(out)


def text(report: dict) -> str:
    """The job log's version: every test's tables, then one verdict line per node."""
    return "\n".join([*(test_text(t) for t in report["tests"]), verdict_text(report)])


def _busbw(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_rich(console, report: dict, report_path: str | Path | None = None) -> None:
    from rich.markup import escape
    from rich.table import Table

    title = (f"cluster validation · {len(report['verdicts'])} node(s) · {report['backend']} · "
             f"{report['devices_per_node']} worker(s)/node · {report['instance_type']}")
    summary = Table(title=escape(title), title_justify="left")
    for column in ("node", "verdict", "health", "intra-node busbw", "pair busbw", "reasons"):
        summary.add_column(column, overflow="fold")
    for name, verdict in report["verdicts"].items():
        checks = report["health"].get(name, [])
        counts = {s: sum(c["status"] == s for c in checks) for s in ("pass", "warn", "fail", "n/a")}
        health = " ".join(f"[{_STATUS_STYLE[s]}]{n} {s}[/]" for s, n in counts.items() if n) or "-"
        state = "[green]pass[/]" if verdict["passed"] else "[bold red]FAIL[/]"
        summary.add_row(escape(name), state, health, _busbw(verdict.get("intra_node_busbw")),
                        _busbw(verdict.get("pair_busbw")),
                        escape("; ".join(verdict["reasons"] + verdict.get("transient", [])) or "-"))
    console.print(summary)

    for name, checks in report["health"].items():
        table = Table(title=escape(f"health · {name}"), title_justify="left")
        for column in ("check", "status", "detail"):
            table.add_column(column, overflow="fold")
        for check in checks:
            style = _STATUS_STYLE.get(check["status"], "")
            table.add_row(escape(check["name"]), f"[{style}]{check['status']}[/]", escape(check["detail"]))
        console.print(table)

    pairs = [t for t in report["tests"] if t["phase"] in PAIR_PHASES]
    if pairs:
        judged = report["judged"]
        table = Table(title=escape(f"pair sweep · {judged['operation']} busbw at {judged['size']} B"),
                      title_justify="left")
        for column in ("round", "phase", "group", "busbw (GB/s)", "result"):
            table.add_column(column, overflow="fold")
        for test in pairs:
            j = test["judged"]
            result = "[green]ok[/]" if j["error"] is None else f"[red]{escape(j['error'])}[/]"
            table.add_row(str(test["round"]), test["phase"], escape(", ".join(test["group"])), _busbw(j["busbw"]),
                          result)
        console.print(table)

    for test in report["tests"]:
        if test["phase"] in PAIR_PHASES:
            continue
        table = Table(title=escape(test_title(test)), title_justify="left")
        for column in ("operation", "size(B)", "count(elems)", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                       "#wrong"):
            table.add_column(column, justify="left" if column in ("operation", "type") else "right")
        for row in test["rows"]:
            if row.get("error"):
                table.add_row(row["operation"], str(row["size"]), str(row["count"]), row["type"],
                              f"[red]{escape(row['error'])}[/]", "", "", "")
                continue
            wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
            table.add_row(row["operation"], str(row["size"]), str(row["count"]), row["type"],
                          f"{row['time_us']:.2f}", f"{row['algbw']:.3f}", f"{row['busbw']:.3f}",
                          wrong if not row["wrong"] else f"[red]{wrong}[/]")
        for error in test["errors"]:
            table.add_row("error", "", "", "", f"[red]{escape(error)}[/]", "", "", "")
        console.print(table)

    for note in report.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(note)}")
    if report_path:
        console.print(f"report: {escape(str(report_path))}")
    bad = report["bad_nodes"]
    if bad:
        console.print(f"[bold red]{len(bad)} bad node(s): {escape(', '.join(bad))}[/]. Keep them out of later "
                      f"launches with:  {escape(report['exclude_override'])}")
    else:
        console.print(f"[green]all {len(report['verdicts'])} node(s) passed[/]")
