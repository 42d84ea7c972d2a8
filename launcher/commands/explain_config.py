"""`nxdt-launch explain-config FILE`: what each key of an NxD Training or NeMo-Launcher YAML becomes here.

Every key of the file is listed with its value and its fate: the nxdt-launch key it maps to, ignored (and why),
or refused (and why). Exit 0 when the file can be launched as `training=@FILE` (a fine-tuning or alignment file as
its own stage: `alignment=@FILE`, ...), 2 when it has refused keys.

--runtime torchtitan adds a second table: the training stage the file composes to (with any OVERRIDES, e.g.
training.model.model_config=PATH where the file's config.json is elsewhere here), key by key, as the torchtitan job
takes it (launcher/titan.py); exit 2 when the torchtitan job cannot be made from it."""

from __future__ import annotations

import click

from launcher.errors import UserError


@click.command(name="explain-config")
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--runtime", type=click.Choice(["nxdt", "torchtitan"]), default="nxdt",
              help="torchtitan: also show what each key becomes in a training.runtime=torchtitan job")
def command(file: str, overrides: tuple[str, ...], runtime: str) -> None:
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
    if runtime == "torchtitan":
        _torchtitan(console, file, stage, list(overrides))
        command += " training.runtime=torchtitan"
    console.print(f"launch it with: nxdt-launch {command}", highlight=False, markup=False)


def titan_explained(file: str, stage: str, overrides: list[str]) -> tuple[list, list[str], list[str]]:
    """(rows, refused, named) of launcher/titan.py explain for the file's training stage as a launch composes it;
    a file of another stage is refused in one line (torchtitan pretrains only)."""
    from launcher import cache, titan
    from launcher.config import parse

    if stage != "training":
        return [], [f"{stage}=@{file}: torchtitan runs the training stage (pretraining) only; this file configures "
                    f"{stage}, which runs on nxdt-launch's own runtime"], []
    cfg, _ = cache.resolved([f"training=@{file}", "stages=[training]", "training.runtime=torchtitan", *overrides])
    return titan.explain(parse(cfg).stage("training").section)


def _torchtitan(console, file: str, stage: str, overrides: list[str]) -> None:
    from rich.table import Table

    rows, refused, named = titan_explained(file, stage, overrides)
    table = Table(title=f"{file} → the torchtitan job (training.runtime=torchtitan)", title_justify="left")
    for column in ("nxdt-launch key", "value", "torchtitan"):
        table.add_column(column, overflow="fold")
    for key, value, fate in rows:
        style = "red" if fate.startswith("refused:") else "dim" if fate.startswith(("named:", "quiet:")) else None
        table.add_row(key, repr(value), fate, style=style)
    console.print(table)
    if named:
        console.print(f"no effect in the torchtitan job: {', '.join(named)}", highlight=False, markup=False)
    if refused:
        raise UserError(*refused)
