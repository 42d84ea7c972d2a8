"""A picture of a training run: loss (and validation loss), learning rate and throughput against the step.

    python -m runtime.plot results/gpt3_tiny/training          # writes results/gpt3_tiny/training/metrics.png

Training draws it at the end of every run (rank 0); `nxdt-launch plot RUN` draws it for any run, running or not.
Reads only metrics.jsonl, the file every sink is fed from, so the picture and TensorBoard cannot disagree.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.io.files import json_lines
from runtime.schema.facts import USER_ERROR_EXIT_CODE

PICTURE = "metrics.png"


def read_metrics(results_dir: str | Path) -> list[dict]:
    """The records of metrics.jsonl; a line cut short by a running writer is left out (it is the last one)."""
    rows = json_lines((Path(results_dir) / "metrics.jsonl").read_text())
    return [row for row in rows if isinstance(row.get("step"), int)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    # A resumed run logs from where it resumed; a step logged twice keeps its latest value.
    points = {row["step"]: float(row[key]) for row in rows if isinstance(row.get(key), (int, float))}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def plot_run(results_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw metrics.jsonl of a training results directory into a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: nodes and CI have no display
    import matplotlib.pyplot as plt

    results_dir = Path(results_dir)
    if not (results_dir / "metrics.jsonl").is_file():
        raise ValueError(f"no metrics.jsonl in {results_dir}: not a training results directory, or no step yet")
    rows = read_metrics(results_dir)
    if not any("loss" in row for row in rows):
        raise ValueError(f"{results_dir / 'metrics.jsonl'} has no training step logged yet")
    out = Path(out) if out else results_dir / PICTURE
    figure, (loss_ax, lr_ax, speed_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss_ax.plot(*_series(rows, "loss"), label="train loss")
    steps, values = _series(rows, "val_loss")
    if steps:
        loss_ax.plot(steps, values, "o-", label="validation loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    lr_ax.plot(*_series(rows, "lr"))
    lr_ax.set_ylabel("learning rate")
    speed_ax.plot(*_series(rows, "tokens_per_s"))
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    for ax in (loss_ax, lr_ax, speed_ax):
        ax.grid(alpha=0.3)
    figure.suptitle(results_dir.parent.name or str(results_dir))
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.tmp")
    figure.savefig(partial, format="png", dpi=100)
    plt.close(figure)
    partial.replace(out)  # a reader (a browser, `plot` while training) never sees half a picture
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.plot", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", help="a training stage's results directory (it holds metrics.jsonl)")
    parser.add_argument("-o", "--output", help=f"the PNG to write (default: <results_dir>/{PICTURE})")
    args = parser.parse_args(argv)
    try:
        print(f"plot: {plot_run(args.results_dir, args.output)}")
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
