"""`nxdt-launch autoconfig [OVERRIDES]`: recommend a model size for a compute budget, rank the parallel layouts
that fit, train the best-ranked few for a few steps each, and keep the fastest as a ready-to-use training config.

    nxdt-launch autoconfig                                   # search_config=gpt3/tiny on this machine (demo data)
    nxdt-launch autoconfig search_config=llama3/8b cluster=pcluster_trn1 data_dir=/fsx/data
    nxdt-launch autoconfig search_config.train_settings.limit_search_runs=8 cluster_type=slurm
    nxdt-launch autoconfig search_config=gpt3/5b --dry-run   # rank the grid, launch nothing

`search_config.*` overrides change the search (conf/search_config/); every other override is a launch override
given to each candidate run, as to `nxdt-launch` itself. Results go to search_config.results_dir: results.csv,
conf/training/autoconfig/<name>.yaml (the best config), and runs/ (one launch per candidate).
"""
from __future__ import annotations

import sys

import click


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--dry-run", is_flag=True, help="Size the model and rank the layouts; launch nothing.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def command(ctx: click.Context, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Search parallel layouts by launching short runs (Hydra overrides; search_config=CHOICE)."""
    from rich.console import Console

    from launcher.autoconfig import driver
    from launcher.commands import command_line

    dry_run = dry_run or (ctx.obj or {}).get("dry_run", False)  # `nxdt-launch --dry-run autoconfig` too
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    produced_by = command_line(ctx)
    ctx.exit(driver.run(list(overrides), dry_run=dry_run, produced_by=produced_by, console=console))
