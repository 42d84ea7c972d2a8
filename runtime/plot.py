"""A picture of a training run: loss (and validation loss), learning rate and throughput against the step; for the
rl stage also its reward (rollouts' and held-out) and its KL and completion length.

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
    rl = any("reward" in row and "completion_length" in row for row in rows)  # the rl stage: its reward, KL, length
    figure, axes = plt.subplots(5 if rl else 3, 1, figsize=(8, 15 if rl else 9), sharex=True)
    loss_ax, lr_ax, speed_ax = axes[:3]
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
    axes[-1].set_xlabel("step")
    if rl:
        _rl_panels(rows, axes[3], axes[4])
    for ax in axes:
        ax.grid(alpha=0.3)
    figure.suptitle(results_dir.parent.name or str(results_dir))
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.tmp")
    figure.savefig(partial, format="png", dpi=100)
    plt.close(figure)
    partial.replace(out)  # a reader (a browser, `plot` while training) never sees half a picture
    return out


def _rl_panels(rows: list[dict], reward_ax, kl_ax) -> None:
    """The rl stage's: the rollouts' mean reward and the held-out greedy one; the KL to the reference and the mean
    completion length."""
    reward_ax.plot(*_series(rows, "reward"), label="rollout reward")
    steps, values = _series(rows, "val_reward")
    if steps:
        reward_ax.plot(steps, values, "o-", label="held-out greedy reward")
    reward_ax.set_ylabel("reward")
    reward_ax.legend()
    kl_ax.plot(*_series(rows, "kl"), label="KL")
    kl_ax.set_ylabel("KL")
    length_ax = kl_ax.twinx()
    length_ax.plot(*_series(rows, "completion_length"), color="tab:orange", label="completion length")
    length_ax.set_ylabel("completion length (tokens)")
    kl_ax.legend(handles=kl_ax.get_lines() + length_ax.get_lines())


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
