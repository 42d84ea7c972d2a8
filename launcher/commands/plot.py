"""`nxdt-launch plot RUN`: the loss, learning rate and throughput of RUN's training as a PNG.

    nxdt-launch plot gpt3_tiny                       # writes results/gpt3_tiny/training/metrics.png
    nxdt-launch plot gpt3_tiny -o /tmp/loss.png

Training draws the same picture when it ends (exp_manager.create_metrics_plot); this draws it at any time,
while the run trains too. It reads metrics.jsonl on this machine: a run launched on a remote head node is
plotted there.
"""
from __future__ import annotations

from pathlib import Path

import click

from launcher.errors import UserError
from launcher.stages import TRAINER_STAGES


@click.command(name="plot")
@click.argument("run")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="The PNG to write (default: metrics.png beside the run's metrics.jsonl).")
@click.option("--results-dir", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
              help="The base_results_dir the run was launched with.")
def command(run: str, output: Path | None, results_dir: Path) -> None:
    """Draw RUN's training metrics (loss, learning rate, tokens/s) into a PNG."""
    from launcher import records, runs

    named = click.get_current_context().get_parameter_source("results_dir") != click.core.ParameterSource.DEFAULT
    record = records.load(runs.require_run(run, results_dir, use_index=not named))
    if record.get("remote"):
        raise UserError(f"run {run!r} was launched on {record['remote'].get('host')}: its metrics are there; "
                        f"run nxdt-launch plot on that head node")
    training = [entry for entry in record["stages"] if entry["stage"] in TRAINER_STAGES]
    if not training:
        raise UserError(f"run {run!r} has no training stage to plot")
    try:
        from runtime.plot import plot_run  # matplotlib, not torch: the launcher's environment may have it
    except ImportError:
        raise UserError("plot needs matplotlib: pip install matplotlib") from None
    try:
        path = plot_run(Path(training[0]["log_dir"]).parent, output)
    except ImportError:
        raise UserError("plot needs matplotlib: pip install matplotlib") from None
    except (OSError, ValueError) as error:
        raise UserError(f"run {run!r}: {error}") from None
    click.echo(f"plot: {path}")
