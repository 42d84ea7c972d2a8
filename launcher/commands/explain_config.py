"""`nxdt-launch explain-config FILE`: what each key of an NxD Training or NeMo-Launcher YAML becomes here.

Every key of the file is listed with its value and its fate: the nxdt-launch key it maps to, ignored (and why),
or refused (and why). Exit 0 when the file can be launched as `training=@FILE` (a fine-tuning or alignment file as
its own stage: `alignment=@FILE`, ...), 2 when it has refused keys."""

from __future__ import annotations

import click

from launcher.errors import UserError


@click.command(name="explain-config")
@click.argument("file", type=click.Path(dir_okay=False))
def command(file: str) -> None:
    """Show how an NxD Training or NeMo-Launcher YAML maps onto nxdt-launch keys (launch: training=@FILE, or
    fine_tuning=, peft=, alignment=@FILE for the stage the file configures)."""
    from rich.console import Console
    from rich.table import Table

    from launcher import nxdt_config

    mapping = nxdt_config.map_file(file)
    table = Table(title=f"{file} ({mapping.dialect}) → nxdt-launch", title_justify="left")
    for column in (f"{mapping.dialect} key", "value", "here"):
        table.add_column(column, overflow="fold")
    for key, value, fate in mapping.rows:
        style = "red" if fate.startswith(("refused", "unknown")) else "dim" if fate.startswith("ignored") else None
        table.add_row(key, repr(value), fate, style=style)
    console = Console(width=160)
    console.print(table)
    for line in mapping.warnings:
        console.print(f"warning: {line}", highlight=False, markup=False)
    if mapping.errors:
        raise UserError(*mapping.errors)
    stage = mapping.stage  # a fine-tuning or alignment file runs as its own stage
    command = f"training=@{file}" if stage == "training" else f"stages=[{stage}] {stage}=@{file}"
    console.print(f"launch it with: nxdt-launch {command}", highlight=False, markup=False)
