"""The `nxdt-launch` command.

    nxdt-launch                                        # the embedded default: demo data + tiny GPT, locally
    nxdt-launch stages=[training] training=llama/tiny  # Hydra overrides, as NeMo-Launcher takes them
    nxdt-launch stages=[training] training=gpt3/tiny cluster_type=slurm --dry-run
    nxdt-launch status [RUN]    nxdt-launch logs RUN [STAGE] [-f]    nxdt-launch cancel RUN
    eval "$(_NXDT_LAUNCH_COMPLETE=bash_source nxdt-launch)"   # tab completion (docs/cli.md)

Only click and rich are imported at start; Jinja loads when a launch renders, Hydra and OmegaConf only when a
launch's config is neither in the launch cache (launcher/cache.py) nor within what launcher/plain_compose.py
composes, and torch never.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.shell_completion import CompletionItem

from launcher.commands import FiniteFloatRange, command_line
from launcher.completion import complete_override, complete_run, complete_stage
from launcher.errors import UserError
from launcher.paths import CONFIG_GROUPS, group_choices
from launcher.stages import TRAINER_STAGES
from runtime.schema.facts import PREEMPTED_EXIT_CODE, USER_ERROR_EXIT_CODE


def _console():
    from rich.console import Console

    # Logs and pipes are read later, often in an editor: don't fold paths at rich's default 80 columns.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _groups_help() -> str:
    lines = ["Config groups (choose with GROUP=CHOICE):"]
    for group in CONFIG_GROUPS:
        lines.append(f"  {group}: {', '.join(group_choices(group))}")
    return "\n".join(lines)


# Commands that live in their own modules, imported only when invoked: "name": ("module", "help line").
# Each module defines a click command called `command`.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "cluster-validate": ("launcher.commands.cluster_validate", "Node health and collective tests that name bad nodes."),
    "cluster-config": ("launcher.commands.cluster_config", "Render an AWS ParallelCluster 3 cluster config."),
    "estimate": ("launcher.commands.estimate", "Memory per device and time to train for a recipe."),
    "explain-config": ("launcher.commands.explain_config", "Show how an NxD Training or NeMo-Launcher YAML maps onto our keys."),
    "autoconfig": ("launcher.commands.autoconfig", "Recommend a model size and search parallel layouts by launching short runs."),
    "plot": ("launcher.commands.plot", "Draw a run's loss, LR and tokens/s into a PNG."),
}


def _available_lazy_commands() -> dict[str, tuple[str, str]]:
    import importlib.util

    return {name: entry for name, entry in LAZY_COMMANDS.items() if importlib.util.find_spec(entry[0])}


class _LaunchGroup(click.Group):
    """Arguments that are not a command name are Hydra overrides for a launch."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *_available_lazy_commands()])

    def get_command(self, ctx, name):
        if name in self.commands:
            return self.commands[name]
        entry = _available_lazy_commands().get(name)
        if entry is None:
            return None
        import importlib

        return importlib.import_module(entry[0]).command

    def format_commands(self, ctx, formatter):
        rows = [(name, self.commands[name].get_short_help_str(limit=100)) for name in super().list_commands(ctx)
                if not self.commands[name].hidden]
        rows += [(name, entry[1]) for name, entry in _available_lazy_commands().items()]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))

    def resolve_command(self, ctx, args):
        if args and self.get_command(ctx, args[0]) is None:
            if not ctx.resilient_parsing:  # shell completion parses half-typed lines: no refusals there
                _refuse_unknown_command(args[0], self.list_commands(ctx))
            return "launch", self.commands["launch"], args
        return super().resolve_command(ctx, args)

    def shell_complete(self, ctx, incomplete):
        """The first word: a command, or an override. Lazy commands are offered by name, not imported."""
        if incomplete.startswith("-"):
            return click.Command.shell_complete(self, ctx, incomplete)  # --dry-run, --help, --version
        commands = {name: self.commands[name].get_short_help_str(limit=60) for name in super().list_commands(ctx)
                    if not self.commands[name].hidden}
        commands.update({name: entry[1] for name, entry in _available_lazy_commands().items()})
        items = [CompletionItem(name, help=help) for name, help in sorted(commands.items())
                 if name.startswith(incomplete)]
        return items + complete_override(ctx, None, incomplete)

    def format_epilog(self, ctx, formatter):
        formatter.write("\n")
        for line in _groups_help().splitlines():
            formatter.write(line + "\n")


def _refuse_unknown_command(word: str, commands: list[str]) -> None:
    """A bare word is neither an override (KEY=VALUE, ~KEY) nor an option: most likely a mistyped command."""
    if "=" in word or word.startswith(("~", "-")) or not word.strip():
        return
    import difflib

    visible = [c for c in commands if c != "launch"]
    match = difflib.get_close_matches(word.lower(), visible, n=1, cutoff=0.6)
    hint = f"did you mean {match[0]!r}? " if match else "did you mean --help? " if word == "help" else ""
    raise UserError(f"{word!r}: no such command and not an override (KEY=VALUE); {hint}"
                    f"commands: {', '.join(visible)}")


def _refuse_misplaced_command(overrides: tuple[str, ...], commands: list[str]) -> None:
    """A bare word after an override (`nxdt-launch training=gpt3/tiny stats`): when it is close to a command, say
    so; Hydra would only call it bad syntax. Commands come first, so the hint says where it goes."""
    import difflib

    visible = [c for c in commands if c != "launch"]
    for word in overrides:
        if "=" in word or word.startswith(("~", "+", "-")) or not word.strip():
            continue
        match = difflib.get_close_matches(word.lower(), visible, n=1, cutoff=0.6)
        if match:
            raise UserError(f"{word!r}: not an override (KEY=VALUE); did you mean the command {match[0]!r}? a "
                            f"command comes first: nxdt-launch {match[0]} ...")



def _version(ctx: click.Context, param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("nxdt-launch")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed: the version it declares
        import tomllib

        from launcher.paths import REPO_ROOT

        number = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    click.echo(f"nxdt-launch {number}")
    ctx.exit(0)


@click.group(cls=_LaunchGroup, invoke_without_command=True, subcommand_metavar="[OVERRIDES]... | COMMAND [ARGS]...",
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dry-run", is_flag=True, help="Render every script and submit nothing (same as dry_run=true).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Print the version of nxdt-launch and exit.")
@click.pass_context
def cli(ctx: click.Context, dry_run: bool) -> None:
    """Compose, validate, render and submit the configured stages, or inspect recorded runs.

    \b
    nxdt-launch                                         the embedded default, locally
    nxdt-launch stages=[training] training=llama/tiny   Hydra overrides, as NeMo-Launcher takes them
    nxdt-launch training=gpt3/175b cluster_type=slurm --dry-run
    """
    ctx.obj = {**(ctx.obj or {}), "dry_run": dry_run}
    if ctx.invoked_subcommand is None:
        ctx.invoke(launch, overrides=(), dry_run=dry_run)


@cli.command(hidden=True, context_settings={"ignore_unknown_options": True})
@click.option("--dry-run", is_flag=True)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED, shell_complete=complete_override)
@click.pass_context
def launch(ctx: click.Context, overrides: tuple[str, ...], dry_run: bool) -> None:
    from launcher import launch as steps
    from launcher.slurm import SlurmError

    _refuse_misplaced_command(overrides, ctx.parent.command.list_commands(ctx.parent) if ctx.parent else [])
    dry_run = dry_run or (ctx.obj or {}).get("dry_run", False)
    produced_by = command_line(ctx)
    plan = steps.make_plan(list(overrides), dry_run=dry_run, produced_by=produced_by)
    console = _console()
    from rich.markup import escape

    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    scripts = steps.write(plan)
    record = steps.new_record(plan, scripts)
    code = 0
    if plan.dry_run:
        for entry in record["stages"]:
            entry["job_id"] = "dry-run"
        if plan.executor == "k8s":  # what would be created, in stage order; nothing contacts the cluster
            for here, _, _ in plan.files:
                if here.name.endswith(".k8s.yaml"):
                    console.out(f"---\n{here.read_text()}", highlight=False)
    elif plan.executor == "slurm":
        try:
            steps.submit_slurm(plan, scripts, record)
        except SlurmError as e:
            raise UserError(str(e)) from None
    _print_plan(console, plan, record)
    if not plan.dry_run and plan.executor == "k8s":
        import os

        from launcher import k8s, runs

        code = k8s.run(plan, record, console, pid_started=runs.process_started(os.getpid()))
    if not plan.dry_run and plan.executor == "local":
        code = steps.run_local(plan, scripts, record, console)
        from launcher import records

        if code != 0 and (cancelled := records.cancelled_stages(plan.run_dir, record)):
            # The training saved a checkpoint and stopped (runtime/preemption.py): the run resumes from it.
            resume = ("; it saved a checkpoint: launch the same command again to resume"
                      if code == PREEMPTED_EXIT_CODE else "")
            console.print(f"cancelled by nxdt-launch cancel: {', '.join(cancelled)}{resume}", highlight=False)
    ctx.exit(code)


def _print_plan(console, plan, record) -> None:
    from rich.markup import escape
    from rich.table import Table

    title = escape(f"run {plan.config.run_name} · {plan.executor} executor ({plan.executor_reason})")
    table = Table(title=title, title_justify="left")
    for column in ("stage", "job id", "nodes × tasks", "dependency", "script"):
        table.add_column(column, overflow="fold")
    for job, entry in zip(plan.jobs, record["stages"]):
        array = f" (array of {job.array_size})" if job.array_size else ""
        table.add_row(job.stage, str(entry["job_id"] or "-"), f"{job.nodes} × {job.nproc_per_node}{array}",
                      entry["dependency"] or "-", escape(entry["script"]))
    console.print(table)
    from launcher.validate import host_memory_note

    for job in plan.jobs:
        if job.stage in TRAINER_STAGES and (note := host_memory_note(plan.estimates.get(job.stage), job.stage)):
            console.print(escape(note), highlight=False)


_results_dir = click.option("--results-dir", type=click.Path(path_type=Path), default=Path("results"),
                            show_default=True, help="The base_results_dir the runs were launched with.")


def _named_results_dir() -> bool:
    """Whether --results-dir was given: then runs are looked for there only, not in the run index."""
    source = click.get_current_context().get_parameter_source("results_dir")
    return source != click.core.ParameterSource.DEFAULT


@cli.command()
@click.argument("run", required=False, shell_complete=complete_run)
@_results_dir
def status(run: str | None, results_dir: Path) -> None:
    """The state of each stage of RUN, or a list of recorded runs."""
    from rich.table import Table

    from launcher import records, run_index, runs

    console = _console()
    named = _named_results_dir()
    if run is None:
        found = records.all_runs(results_dir)
        if not named:  # and every run launched from anywhere else
            seen = {p.resolve() for p in found}
            found += [p for p in run_index.all_runs() if p.resolve() not in seen]
        if not results_dir.is_dir() and (named or not found):
            # An empty table would read as "no runs there"; a mistyped directory should say so.
            raise UserError(f"--results-dir: {results_dir} is not a directory; give the base_results_dir the runs "
                            "were launched with, e.g. --results-dir /fsx/results")
        title = f"runs under {results_dir}" if named else f"runs under {results_dir} and in {run_index.index_path()}"
        table = Table(title=title, title_justify="left")
        for column in ("run", "executor", "created", "stages", "results dir"):
            table.add_column(column, overflow="fold")
        unreadable = []
        for run_dir in found:
            try:
                record = records.load(run_dir)
            except UserError as e:  # one damaged record does not hide the others
                unreadable += e.problems
                continue
            table.add_row(run_dir.name, record["executor"], record["created"],
                          ", ".join(e["stage"] for e in record["stages"]), str(run_dir.parent))
        console.print(table)
        for problem in unreadable:
            click.echo(f"warning: {problem}", err=True)
        return
    record = records.load(runs.require_run(run, results_dir, use_index=not named))
    runs.use_record(record)
    table = Table(title=f"run {record['run_name']} ({record['executor']}, launched {record['created']})",
                  title_justify="left")
    for column in ("stage", "job id", "state", "log dir"):
        table.add_column(column, overflow="fold")
    rows = runs.stage_states(record)
    for entry, state in rows:
        table.add_row(entry["stage"], str(entry["job_id"]), str(state), entry["log_dir"])
    console.print(table)
    for entry, state in rows:
        progress = runs.training_progress(entry) if entry["stage"] in TRAINER_STAGES and state.state == "RUNNING" else None
        if progress:
            click.echo(f"{entry['stage']}: {progress}")
        if record["executor"] == "slurm" and entry["stage"] in TRAINER_STAGES:
            for line in runs.attempt_history(entry):
                click.echo(f"{entry['stage']}: {line}")
    from runtime.io import run_lock

    for entry in record["stages"]:
        holder = run_lock.holder(Path(entry["log_dir"]).parent) if entry["stage"] in TRAINER_STAGES else None
        if holder is not None:
            click.echo(f"training is held by {run_lock.describe(holder)} (its {run_lock.LOCK} lock)")


@cli.command()
@click.argument("run", shell_complete=complete_run)
@click.argument("stage", required=False, shell_complete=complete_stage)
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing as the logs grow, until the stage (or every stage) has ended.")
@_results_dir
def logs(run: str, stage: str | None, follow: bool, results_dir: Path) -> None:
    """Print the logs of RUN (one STAGE, or all)."""
    from launcher import records, runs

    run_dir = runs.require_run(run, results_dir, use_index=not _named_results_dir())
    record = records.load(run_dir)
    runner = runs.use_record(record)  # the head node over SSH for a remote run
    source = runs.launch_of(run_dir, record, stage)  # an earlier launch's, for a stage this launch did not run
    files = runs.log_files(source, stage) if stage or follow else runs.every_log_file(run_dir, record)
    if not files and (not follow or runs.ended(source, stage)):
        raise UserError(f"run {run!r}: no logs yet for {stage or 'any stage'} (is it still pending?)")
    if follow and source is record:  # an earlier launch's stage has ended: its logs are printed whole
        runs.follow(run_dir, record, stage, lambda text: click.echo(text, nl=False))
        return
    for path in files:
        click.echo(f"==> {path} <==")
        click.echo(runner.read_text(str(path)), nl=False)


@cli.command()
@click.argument("run", shell_complete=complete_run)
@click.option("--timeout", type=FiniteFloatRange(min=0, min_open=True, unit="seconds"), default=300,
              show_default=True, help="Local runs: how long the training may take to save and stop before it is "
                                      "sent SIGTERM.")
@_results_dir
def cancel(run: str, timeout: float, results_dir: Path) -> None:
    """Cancel every stage of RUN that has not finished. A local training saves a checkpoint first."""
    from launcher import records, runs
    from launcher.slurm import SlurmError

    run_dir = runs.require_run(run, results_dir, use_index=not _named_results_dir())
    record = records.load(run_dir)
    runs.use_record(record)
    try:
        click.echo(runs.cancel(record, run_dir, timeout_s=timeout))
    except SlurmError as e:
        raise UserError(str(e)) from None


# A mistake repeated over thousands of keys (a wrong file given as a config) is named by its first lines.
MAX_ERRORS = 20


def run(argv: list[str]) -> int:
    """Everything `nxdt-launch ARGV...` does, in this process, returning its exit code: a user mistake is printed
    as `error: ...` lines on stderr and returns 2. Anything else that escapes is our bug, and keeps its traceback."""
    try:
        code = cli.main(args=list(argv), prog_name="nxdt-launch", standalone_mode=False, obj={"argv": list(argv)})
    except UserError as e:
        for problem in e.problems[:MAX_ERRORS]:
            # One line per problem, even when it quotes a value that holds a line break.
            click.echo("error: " + problem.replace("\r", "\\r").replace("\n", "\\n"), err=True)
        if len(e.problems) > MAX_ERRORS:
            click.echo(f"error: ... and {len(e.problems) - MAX_ERRORS} more problems of the same input; fix the "
                       f"ones above and run it again", err=True)
        return USER_ERROR_EXIT_CODE
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.UsageError as e:
        # Click's usage errors (a bad option value, a missing argument) as one line like every other mistake.
        command = e.ctx.command_path if e.ctx else "nxdt-launch"
        param = getattr(e, "param", None)
        if isinstance(e, click.BadParameter) and not isinstance(e, click.MissingParameter) and e.message \
                and param is not None and getattr(param, "opts", None):
            message = f"{param.opts[0]}: {e.message}"  # the option first, as every other error names its key
        else:
            message = e.format_message()
        click.echo(f"error: {message} (see {command} --help)", err=True)
        return USER_ERROR_EXIT_CODE
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        return USER_ERROR_EXIT_CODE
    except click.Abort:
        return 130
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
