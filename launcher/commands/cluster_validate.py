"""`nxdt-launch cluster-validate [OVERRIDES...]`: node health and collective tests that name bad nodes.

    nxdt-launch cluster-validate                                   # every idle node of cluster.partition
    nxdt-launch cluster-validate cluster=pcluster_trn1             # Neuron: 32 workers, nccom-test, EFA env
    nxdt-launch cluster-validate cluster.nodelist=[node1,node2] devices=8 accelerator=gpu
    nxdt-launch cluster-validate cluster_type=local devices=2      # this machine alone
    nxdt-launch cluster-validate --show                            # print the last report again

Overrides are Hydra's, composed with the launch config; keys of the `cluster_validation` group may be given
without their prefix (`devices=2` is `cluster_validation.devices=2`). One job runs the agent on every node
(csp_tools/cluster_validate); this command waits for it, prints the report and exits 1 when a node failed,
after writing `cluster.exclude=[...]` to exclude_override.txt for later launches. A dry run prints the job script
and asks Slurm nothing: with `nodes: null` it renders DRY_RUN_NODES nodes and says on stderr that which nodes are
idle was not checked.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from launcher.commands import FiniteFloatRange
from launcher.config import LaunchConfig, composed_run, parse_run, typed
from launcher.errors import UserError, print_not_checked
from launcher.paths import CONFIG_GROUPS
from launcher.slurm import expand_hostlist, split_hostlist
from runtime.schema import rules
from runtime.schema.choices import DEFAULT_DEPENDENCY
from runtime.schema.rules import slurm_seconds

STAGE = "cluster_validation"
# What a dry run renders for `nodes: null` (every idle node) without asking Slurm: the fewest nodes the pair and
# all-nodes tests run on.
DRY_RUN_NODES = 2
# The launch config's own keys and its groups: `KEY=...` for one of these is never a cluster_validation key.
_TOP_LEVEL = ("stages", "cluster_type", "dry_run", "run_name", "base_results_dir", "data_dir", "launcher_scripts_path",
              "env_vars", "container", "container_mounts", "python", *CONFIG_GROUPS)
_GROUP_KEYS = ("run", "nodes", "accelerator", "devices", "instance_type", "port", "register_timeout_s",
               "task_timeout_s", "health", "collectives", "sweep", "nccom_test", "expected", "thresholds")


def with_group_prefix(override: str) -> str:
    """`devices=2` -> `cluster_validation.devices=2`; anything else unchanged."""
    match = re.match(r"^([+~]{0,2})([A-Za-z_][\w]*)(.*)$", override)
    if match and match.group(2) in _GROUP_KEYS and match.group(2) not in _TOP_LEVEL:
        return f"{match.group(1)}{STAGE}.{match.group(2)}{match.group(3)}"
    return override


def idle_nodes(partition: str | None) -> list[str]:
    argv = ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"] + (["-p", partition] if partition else [])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UserError(f"{STAGE}.nodes: null asks Slurm for the idle nodes, but sinfo failed ({error}); "
                        f"set {STAGE}.nodes=N or cluster.nodelist=[...]") from None
    if done.returncode != 0:
        raise UserError(f"sinfo: {done.stderr.strip()}; set {STAGE}.nodes=N or cluster.nodelist=[...]")
    return list(dict.fromkeys(done.stdout.split()))


def choose_nodes(cfg: LaunchConfig | dict, executor: str, *, dry_run: bool = False
                 ) -> tuple[int, list[str], list[str], list[str]]:
    """(node count, nodelist to render, errors, what was not checked): cluster.nodelist, else a count, else every
    idle node. A dry run does not ask Slurm which nodes are idle: the answer changes by the minute, and a dry run
    renders the same wherever it runs (a laptop, a head node whose nodes are all busy). It renders DRY_RUN_NODES
    nodes of the partition, without a node list, and says so."""
    cfg = typed(cfg)
    cluster = cfg.cluster
    wanted = cfg.composed_section(STAGE).get("nodes")
    if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1):
        return 1, [], [f"{STAGE}.nodes: {wanted!r} must be a positive integer or null (every idle node)"], []
    if executor == "local":
        if wanted not in (None, 1):
            return 1, [], [f"{STAGE}.nodes: {wanted}: a local run validates this machine only; use "
                           f"{STAGE}.nodes=1 or cluster_type=slurm"], []
        return 1, [], [], []
    listed = [n for item in cluster.nodelist or [] for n in expand_hostlist(str(item))]
    if listed:
        return (wanted or len(listed)), list(cluster.nodelist), [], []
    if wanted:
        return wanted, [], [], []
    where = f"partition {cluster.partition}" if cluster.partition else "the default partition"
    if dry_run:
        return DRY_RUN_NODES, [], [], [
            f"which nodes of {where} are idle ({STAGE}.nodes=null validates every idle one; a dry run does not ask "
            f"Slurm): rendered for {DRY_RUN_NODES} nodes without a node list; set {STAGE}.nodes=N or "
            f"cluster.nodelist=[...] to render those"]
    excluded = {n for item in cluster.exclude or [] for n in expand_hostlist(str(item))}
    idle = [n for n in idle_nodes(cluster.partition) if n not in excluded]
    if not idle:
        return 1, [], [f"{STAGE}.nodes: no idle node in {where}; set {STAGE}.nodes=N or cluster.nodelist=[...]"], []
    return len(idle), idle, [], []


def make_plan(overrides: list[str], *, dry_run: bool, produced_by: str):
    from launcher import launch, validate
    from launcher.compose import compose, resolve
    from launcher.config import parse, parse_cluster
    from launcher.job import Job

    from csp_tools.cluster_validate import config as cv_config

    composed = resolve(compose([with_group_prefix(o) for o in overrides]))
    cfg = parse(composed)
    dry_run = dry_run or cfg.dry_run
    for key in ("cluster", STAGE):
        if not isinstance(cfg.composed_section(key) or {}, dict):
            raise UserError(f"{key}: {cfg.composed_section(key)!r} must be a mapping; choose one with {key}=NAME")
    cluster = dict(cfg.composed_section("cluster") or {})
    errors = validate.cluster(cfg.cluster)
    if not errors:  # choose_nodes reads lists: a hostlist string becomes its items
        cluster.update({key: split_hostlist(cluster[key]) for key in ("nodelist", "exclude")
                        if isinstance(cluster.get(key), str)})
    cfg = dataclasses.replace(cfg, cluster=parse_cluster(cluster))
    section = cfg.composed_section(STAGE)
    validation = None
    try:
        validation = cv_config.parse(section, cluster_exclude=cfg.cluster.exclude or [])
    except cv_config.ConfigError as error:
        errors += error.problems
    run = composed_run(section)
    if not isinstance(run, dict):
        raise UserError(f"{STAGE}.run: {run!r} must be a mapping; set its keys one at a time, e.g. "
                        f"{STAGE}.run.time_limit=0:30:00")
    run = parse_run(run)
    name = str(run.name or "")
    if not re.match(r"^[A-Za-z0-9_.+-]+$", name):
        errors.append(f"{STAGE}.run.name: {name!r} must be letters, digits and _.+- (it names a directory)")
    elif problem := rules.run_name(name, f"{STAGE}.run.name"):  # '.', '..', too long
        errors.append(problem)
    if problem := rules.results_dir(run.results_dir, f"{STAGE}.") or \
            rules.slurm_pattern(str(run.results_dir), f"{STAGE}.run.results_dir"):
        errors.append(problem)
    limit_text = str(run.time_limit)
    unlimited = limit_text.upper() in ("UNLIMITED", "INFINITE")
    time_limit = 7 * 86400 if unlimited else slurm_seconds(limit_text)  # UNLIMITED: a week
    if problem := rules.time_limit(run.time_limit, f"{STAGE}."):
        errors.append(problem)
        time_limit = 0
    if cfg.cluster_type not in validate.CLUSTER_TYPES:
        errors.append(f"cluster_type: {cfg.cluster_type!r} is not one of {', '.join(validate.CLUSTER_TYPES)}")
    remote_host = (cfg.cluster.remote or {}).get("host")
    if remote_host:
        errors.append(f"cluster.remote.host: cluster-validate runs on the cluster itself; log in to {remote_host} "
                      "and run it there, or set cluster.remote.host=null")
    executor, reason = launch.choose_executor(str(cfg.cluster_type))
    if executor == "local" and cfg.container:
        errors.append("container: the local executor runs this machine's Python; set container=null")
    if errors:
        raise UserError(*errors)
    nodes, nodelist, errors, unchecked = choose_nodes(cfg, executor, dry_run=dry_run)
    if errors:
        raise UserError(*errors)
    results_dir = Path(run.results_dir)
    if errors := launch.output_problems([(f"{STAGE}.run.results_dir", results_dir)]):
        raise UserError(*errors)
    job = Job(
        stage=STAGE, run_name=name, results_dir=results_dir, nodes=nodes, nproc_per_node=1, distributed=False,
        accelerator=validation.accelerator,
        program=("-m", "csp_tools.cluster_validate", "--config", str(results_dir / f"{STAGE}_config.yaml")),
        time_limit=str(run.time_limit), dependency=DEFAULT_DEPENDENCY,
        stage_config={**section, "launch": {"cluster_exclude": list(cfg.cluster.exclude or []),
                                            "nodes": nodes, "executor": executor}},
    )
    plan_cfg = {**composed, "run_name": name, "cluster": {**cluster, "nodelist": nodelist}}
    plan = launch.Plan(plan_cfg, executor, reason, [job], [], produced_by, dry_run, unchecked=unchecked)
    return plan, time_limit


def _console():
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _load_report(results_dir: Path, wait_s: float) -> dict | None:
    from csp_tools.cluster_validate import report

    deadline = time.monotonic() + wait_s
    while True:  # a shared file system may show the job's file a little after the job ended
        try:
            return report.load(results_dir)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return None
            time.sleep(1)


def _show(console, job_results: Path, log_dir: Path, wait_s: float) -> int:
    from csp_tools.cluster_validate import report

    data = _load_report(job_results, wait_s)
    if data is None:
        console.print(f"[red]error:[/] no {report.REPORT_FILE} in {job_results}; the job's logs: {log_dir}")
        return 1
    report.print_rich(console, data, job_results / report.REPORT_FILE)
    return 0 if data["passed"] else 1


def _wait_for_job(console, job_id: str, log_dir: Path, timeout_s: float) -> str:
    from launcher import slurm

    deadline = time.monotonic() + timeout_s
    with console.status(f"cluster validation job {job_id} running"):
        while True:
            try:
                state = slurm.state(job_id, sorted(log_dir.glob(f"{STAGE}_{job_id}_*.exit")))
            except slurm.SlurmError as error:
                raise UserError(str(error)) from None
            if state.state in slurm.FINISHED:
                return str(state)
            if time.monotonic() > deadline:
                return f"still {state} after {timeout_s:.0f}s"
            time.sleep(2)


@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]})
@click.option("--dry-run", is_flag=True, help="Render the job script and submit nothing.")
@click.option("--no-wait", is_flag=True, help="Submit and return; print the report later with --show.")
@click.option("--show", is_flag=True, help="Print the report of the last validation, run nothing.")
@click.option("--timeout", type=FiniteFloatRange(0, min_open=True, unit="seconds"), default=None,
              help="Seconds to wait for the job (default: its time limit plus two minutes).")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def command(ctx: click.Context, overrides: tuple[str, ...], dry_run: bool, no_wait: bool, show: bool,
            timeout: float | None) -> None:
    """Node health and collective tests over Slurm nodes (or this machine) that name bad nodes."""
    from launcher import launch
    from launcher.commands import command_line
    from launcher.slurm import SlurmError

    dry_run = dry_run or (ctx.obj or {}).get("dry_run", False)
    console = _console()
    produced_by = command_line(ctx)
    if show:
        from launcher.compose import compose, resolve

        section = resolve(compose([with_group_prefix(o) for o in overrides])).get(STAGE)
        run = composed_run(section) if isinstance(section, dict) else None
        if not isinstance(run, dict) or not parse_run(run).results_dir:
            raise UserError(f"{STAGE}.run.results_dir: {run!r} names no results directory; --show reads the report "
                            "from there (give the overrides the validation ran with)")
        results = Path(str(parse_run(run).results_dir))
        ctx.exit(_show(console, results, results / "logs", 0))
    plan, time_limit = make_plan(list(overrides), dry_run=dry_run, produced_by=produced_by)
    job = plan.jobs[0]
    scripts = launch.write(plan)
    record = launch.new_record(plan, scripts)
    nodelist = plan.config.cluster.nodelist
    where = f"{job.nodes} node(s)" + (f" ({','.join(nodelist)})" if nodelist else "")
    console.print(f"cluster validation on {where} · {plan.executor} executor ({plan.executor_reason})")
    console.print(f"script: {scripts[0]}")
    if plan.dry_run:
        click.echo(plan.local_path(scripts[0]).read_text(), nl=False)  # as written, never through rich markup
        print_not_checked(plan.unchecked)
        ctx.exit(0)
    if plan.executor == "local":
        code = launch.run_local(plan, scripts, record, console)
        ctx.exit(_show(console, job.results_dir, job.log_dir, 5) or (1 if code else 0))
    try:
        launch.submit_slurm(plan, scripts, record)
    except SlurmError as error:
        raise UserError(str(error)) from None
    job_id = str(record["stages"][0]["job_id"])
    console.print(f"job {job_id}; logs: {job.log_dir}")
    if no_wait:
        console.print(f"print the report when it is done: nxdt-launch cluster-validate --show "
                      f"{shlex.join(list(overrides))}".rstrip())
        ctx.exit(0)
    state = _wait_for_job(console, job_id, job.log_dir, timeout if timeout is not None else time_limit + 120)
    console.print(f"job {job_id}: {state}")
    if state.startswith("still"):
        console.print("print the report when it is done: nxdt-launch cluster-validate --show (same overrides)")
        ctx.exit(1)
    ctx.exit(_show(console, job.results_dir, job.log_dir, 15))
