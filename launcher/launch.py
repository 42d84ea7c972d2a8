"""A launch, in three steps that the CLI calls in order: plan (compose + validate + build jobs; pure apart
from reading conf/), write (stage configs and scripts; the only files a dry run leaves), and submit or run
(the side effect). Nothing is written unless the plan is valid.

A remote launch (cluster.remote.host) renders the same files into a local mirror of the head node's paths
(remote.state_dir()/remote/<host>/...), copies them there over SFTP, and submits over SSH."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from launcher import (cache, k8s, k8s_pod, live, neuron, packages, records, remote, runs, slurm, stages, staging,
                      titan, validate)
from launcher.config import LaunchConfig, parse, shape, typed
from launcher.errors import UserError
from launcher.job import Job
from launcher.paths import dry_run_dir
from launcher.render import render
from runtime.io import ownership
from runtime.schema import rules


@dataclass
class Plan:
    cfg: dict[str, Any]          # as composed (what config_hash hashes); read through `config`
    executor: str                # slurm | local | k8s
    executor_reason: str         # why: shown in the table's title
    jobs: list[Job]
    warnings: list[str]
    produced_by: str
    dry_run: bool
    remote: dict[str, Any] | None = None   # cluster.remote of a remote launch
    files: list[tuple[Path, Path, int]] = field(default_factory=list)  # written: (here, on the cluster, mode)
    unchecked: list[str] = field(default_factory=list)  # what a dry run rendered without asking (the cluster's state)
    mirror: Path | None = None   # a dry run of a live run writes here (live.py), each file at its path below it
    launch_lock: Any = None      # a real launch's hold on its run (live.hold_launch), from write() to the process's end
    # Each trainer stage's estimate, made by validate's memory check from the schema's one reading of the stage:
    # what the plan table's host-memory line prints.
    estimates: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def config(self) -> LaunchConfig:
        return parse(self.cfg)

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    def local_path(self, path: Path) -> Path:
        """Where this machine writes a file that lives at `path` on the cluster."""
        if self.mirror is not None:
            return self.mirror / path.relative_to(path.anchor)
        if self.remote is None:
            return path
        return remote.state_dir() / "remote" / str(self.remote["host"]) / path.relative_to(path.anchor)


def choose_executor(cluster_type: str, remote_host: str | None = None) -> tuple[str, str]:
    if remote_host and cluster_type in ("auto", "slurm", "bcm"):
        return "slurm", f"cluster_type={cluster_type}: sbatch on {remote_host} over SSH"
    if cluster_type in ("slurm", "bcm"):
        return "slurm", f"cluster_type={cluster_type}"
    if cluster_type == "local":
        return "local", "cluster_type=local"
    if cluster_type == "k8s":
        return "k8s", "cluster_type=k8s: one Kubernetes object per stage"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if shutil.which("sbatch") and Path(conf).exists():
        return "slurm", f"cluster_type=auto: sbatch and {conf} found"
    return "local", "cluster_type=auto: no Slurm here"


def make_plan(overrides: list[str], *, dry_run: bool, produced_by: str) -> Plan:
    cfg, file_warnings = cache.resolved(overrides)  # Hydra's compose, or its result for the same inputs
    if errors := shape(cfg):  # what parse, and every check below, reads
        raise UserError(*errors)
    config = parse(cfg)
    dry_run = dry_run or config.dry_run
    remote_settings = remote.settings(config)
    # Its record first, before the slower checks: a relaunch of a live run is refused at once (live.py).
    found = None if remote_settings else live.recorded(config.base_results_dir, config.run_name)
    if found and not dry_run:
        raise UserError(live.refusal(str(config.run_name), found))
    executor, reason = choose_executor(str(config.cluster_type), (remote_settings or {}).get("host"))
    # A remote launch renders here for a file system it cannot see: missing inputs are warnings, as in a dry run.
    estimates: dict[str, Any] = {}
    errors, warnings = validate.problems(config, dry_run=dry_run or remote_settings is not None,
                                         local=executor == "local", estimates=estimates)
    errors += neuron.problems(config) + remote.problems(config) + staging.problems(config) + k8s.problems(config)
    if not errors:  # training.runtime=torchtitan: what it cannot take, on a config the schema has read
        titan_errors, titan_warnings = titan.problems(config)
        errors += titan_errors
        warnings += titan_warnings
    # A k8s launch writes onto the pods' shared volume: a dry run without it renders elsewhere (below).
    unmounted = k8s.mount_problems(config) if executor == "k8s" else []
    if not dry_run:
        errors = unmounted + errors
    if executor == "local" and config.container:
        errors.append("container: the local executor runs this machine's Python; set container=null "
                      "or use cluster_type=slurm")
    # A package the jobs' Python lacks would fail a job minutes in; a dry run only shows what would run.
    if dry_run:
        warnings += packages.problems(config)
    else:
        errors += packages.problems(config)
    if errors:
        raise UserError(*errors)
    launch_id = new_launch_id()
    jobs = [job.in_launch(launch_id) for job in build(config, dry_run=dry_run)]
    if executor == "k8s" and (errors := k8s.job_problems(config, jobs, produced_by)):
        raise UserError(*errors)  # the shared volume's rules, and each manifest against the vendored schemas
    if executor == "slurm" and jobs and (errors := validate.excluded_every_node(
            config.cluster, max(job.allocated_nodes for job in jobs), ask_slurm=not dry_run and not remote_settings)):
        raise UserError(*errors)
    if executor != "slurm" and (errors := validate.slurm_recovery_only(jobs, executor)):
        raise UserError(*errors)
    mirror = None
    if remote_settings:
        reason += f"; rendered under {remote.state_dir() / 'remote' / str(remote_settings['host'])}"
    elif unmounted:  # a dry run of a k8s launch from a machine without the shared volume (a laptop)
        mirror = dry_run_dir(str(config.run_name))
        warnings.append(f"the shared volume ({k8s.settings(config)['volume']['mount_path']}) is not mounted here: this "
                        f"dry run wrote its files under {mirror} (each at its path below that directory)")
        reason += f"; rendered under {mirror}, the shared volume not being mounted here"
    elif errors := output_problems([("base_results_dir", config.run_dir),
                                    *((f"{job.stage}.run.results_dir", job.results_dir) for job in jobs)]):
        raise UserError(*errors)  # a remote launch writes into its local mirror, and the head node checks its own
    elif errors := live.ownership_problems(config, jobs):
        raise UserError(*errors)
    elif found := found or live.locked(jobs):
        if not dry_run:
            raise UserError(live.refusal(str(config.run_name), found))
        # What the launch would write, rendered where the live run cannot see it: the paths inside are the real ones.
        mirror = dry_run_dir(str(config.run_name))  # the one an earlier dry run of it left is removed
        warnings.append(f"run {config.run_name} is live ({found.what}): this dry run wrote its files under {mirror} "
                        f"(each at its path below that directory), not into the run")
        reason += f"; rendered under {mirror}, the run being live"
    return Plan(cfg, executor, reason, jobs, file_warnings + warnings, produced_by, dry_run, remote_settings,
                mirror=mirror, estimates=estimates)


def output_problems(targets: list[tuple[str, Path]]) -> list[str]:
    """Whether each (key, directory) can be created and written, found before anything is written: every name in
    it fits NAME_MAX, and the deepest part that exists is a directory that takes a new one (tried with a directory
    made and removed at once: permissions alone do not tell, for root or on /proc). Each problem once, under the
    first key that leads to it."""
    errors, tried = [], set()
    for key, path in targets:
        if too_long := rules.path_length(path, key):  # NAME_MAX and PATH_MAX: the schema's one rule
            errors.append(too_long)
            continue
        existing = path
        while not os.path.lexists(existing) and existing != existing.parent:
            existing = existing.parent
        if existing in tried:
            continue
        tried.add(existing)
        if not os.path.isdir(existing):
            errors.append(f"{key}: cannot create {path}: {existing} is a file, not a directory; give a directory"
                          f"{_example(key)}")
            continue
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".nxdt-launch-probe-", dir=existing))
        except OSError as error:
            errors.append(f"{key}: cannot create {path}: {existing} takes no new directory ({error.strerror}); "
                          f"give a directory you can write{_example(key)}")
    return errors


def _example(key: str) -> str:
    return f", e.g. {key} /fsx/out" if key.startswith("-") else f", e.g. {key}=/fsx/results"


def build(cfg: LaunchConfig | dict[str, Any], *, dry_run: bool = False) -> list[Job]:
    """One Job per stage. Stage configs read S3 data at its mirror on the shared file system (staging.py)."""
    cfg = typed(cfg)
    local = staging.localize(cfg)
    jobs = []
    for stage in cfg.stages:
        section = cfg.stage(stage).section
        if stage == "data_preparation" and (staging.has_s3_inputs(section)
                                            or dry_run and validate.inputs_unseen(section)):
            # Its inputs are not here to count (on S3, or on a cluster's file system this dry run cannot see):
            # the array has one task per file the config names.
            jobs.append(stages.data_preparation(local, tasks=staging.count_input_files(section)))
        else:
            jobs.append(stages.BUILDERS[stage](local))
    return jobs


def new_launch_id() -> str:
    """A name for one launch's files: when it was made (UTC, to the second) and 16 random bits, so that two launches
    of a run in the same second (a dry run and the real one) never share one."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


SCRIPT_NAMES = {"slurm": "{}.sbatch", "local": "{}.local.sh", "k8s": "{}.k8s.yaml"}


def script_path(job: Job, executor: str) -> Path:
    return job.results_dir / SCRIPT_NAMES[executor].format(job.stage)


def write(plan: Plan) -> list[Path]:
    """Stage configs, compile-step configs, staging manifests and scripts. Returns the scripts' paths on the
    cluster (the same as here unless the launch is remote). If the file system refuses one (full, read-only,
    gone since make_plan looked), what this call made is removed again and the error names the file."""
    made: list[Path] = []  # directories this call created (the topmost of each chain) and files it wrote
    if not plan.dry_run and plan.remote is None and plan.mirror is None and plan.launch_lock is None:
        _hold_run(plan, made)
    try:
        return _write(plan, made)
    except OSError as error:
        _remove(made)
        plan.files.clear()
        raise UserError(f"{error.filename or 'a launch file'}: cannot be written ({error.strerror or error}); "
                        "nothing was written; free the space or fix the permissions and launch again") from None


def _hold_run(plan: Plan, made: list[Path]) -> None:
    """The run's launch lock, then make_plan's look at the run again under it: a launch of the same run that won the
    race has written its record (or holds a training's lock) by the time it lets go. Then the run's ownership of the
    directories it writes into is recorded (runtime/io/ownership.py); another run that recorded one first refuses
    this launch. A refusal writes nothing: what this call made (the run directory, its lock file, records) goes."""
    try:
        _makedirs(plan.run_dir, made)
    except OSError as error:
        raise UserError(f"base_results_dir: cannot create {plan.run_dir} ({error.strerror}); give a directory you "
                        f"can write, e.g. base_results_dir=/fsx/results") from None
    try:
        plan.launch_lock = live.hold_launch(plan.run_dir, str(plan.config.run_name), made)
        found = live.recorded(plan.config.base_results_dir, plan.config.run_name) or live.locked(plan.jobs)
        if found:
            raise UserError(live.refusal(str(plan.config.run_name), found))
        _claim(plan, made)
    except UserError:
        _remove(made)  # the lock file too, still held: a launch waiting on it opens the name again (live.py)
        if plan.launch_lock is not None:
            plan.launch_lock.close()
            plan.launch_lock = None
        raise
    live.announce(plan.launch_lock)


def _claim(plan: Plan, made: list[Path]) -> None:
    """Record the run as the owner of its run directory and of each directory outside it that it writes into."""
    mine = ownership.of_run(plan.run_dir, str(plan.config.run_name))
    inside = plan.run_dir.resolve()
    for target in live.targets(plan.config, plan.jobs):
        path = Path(os.path.abspath(target.path))
        if not target.claim or (target.key != "base_results_dir" and path.resolve().is_relative_to(inside)):
            continue
        try:
            _makedirs(path, made)
            if not os.path.lexists(path / ownership.OWNER):
                made.append(path / ownership.OWNER)
            theirs = ownership.claim(path, mine)
        except OSError as error:
            raise UserError(f"{target.key}: cannot write {path} ({error.strerror or error}); give a directory you can "
                            f"write") from None
        if theirs.run_id != mine.run_id:
            raise UserError(f"{target.key}: {target.path} belongs to {theirs.describe()}, which claimed it while this "
                            f"launch started; {target.fix}")


def _remove(made: list[Path]) -> None:
    for path in reversed(made):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _makedirs(path: Path, made: list[Path]) -> None:
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    if not top.exists():
        made.append(top)
    path.mkdir(parents=True, exist_ok=True)


def _copy_code(target: Path) -> None:
    """This nxdt-launch's runtime/ and csp_tools/ (render.CODE_PACKAGES) into `target`, for a k8s stage's pods."""
    from launcher.render import CODE_PACKAGES, code_root

    for package in CODE_PACKAGES:
        shutil.copytree(Path(code_root()) / package, target / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _write(plan: Plan, made: list[Path]) -> list[Path]:
    import yaml

    def replace(here: Path, make) -> None:
        """Make the file (`make(tmp)`) beside `here`, then rename it into place: a process that has the old one open
        (bash reads its script as it runs it) goes on reading the old one, never a mix of both."""
        _makedirs(here.parent, made)
        if not os.path.lexists(here):
            made.append(here)
        tmp = here.with_name(f".{here.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        made.append(tmp)
        make(tmp)
        os.replace(tmp, here)
        made.remove(tmp)

    def put(path: Path, text: str, mode: int = 0o644) -> None:
        here = plan.local_path(path)
        replace(here, lambda tmp: (tmp.write_text(text), tmp.chmod(mode)))
        plan.files.append((here, path, mode))

    scripts, copied = [], set()
    for job in plan.jobs:
        if plan.executor == "k8s":  # the stage's Kubernetes object, its pods running the node script
            text = k8s.manifest(job, plan.config, produced_by=plan.produced_by)
            code = plan.local_path(k8s_pod.code_dir(job))
            if not plan.dry_run and code not in copied:  # the code the pods run, in the launch's directory
                replace(code, _copy_code)                  # (stages that share a results_dir share it)
                copied.add(code)
        else:
            text = render(job, plan.config, executor=plan.executor, produced_by=plan.produced_by)
        # Slurm opens #SBATCH --output before the script runs: the log directory must exist at submit time.
        _makedirs(plan.local_path(job.log_dir), made)
        put(job.config_path, yaml.safe_dump(job.stage_config, sort_keys=False))
        if job.stage == "training" and stages.runs_torchtitan(job.stage_config):  # its program (contract 2)
            put(stages.titan_module_path(job), titan.module_text(job.stage_config))
        if job.config_dir is not None and plan.remote is None:
            # <stage>_config.yaml: the newest launch's config, where a user (and NeMo-Launcher's habit) looks for it.
            target = job.config_path.relative_to(job.results_dir)
            replace(plan.local_path(job.results_dir / job.config_path.name), lambda tmp: tmp.symlink_to(target))
        neuron_script = neuron.script(job, plan.config)
        if neuron_script and neuron_script.compile:
            put(neuron_script.compile.config_path, yaml.safe_dump(neuron_script.compile.config, sort_keys=False))
        stage_plan = staging.for_job(job, plan.config)
        if stage_plan:
            put(stage_plan.manifest_path, json.dumps(stage_plan.manifest(), indent=2) + "\n")
        path = script_path(job, plan.executor)
        put(path, text, 0o755)
        scripts.append(plan.local_path(path) if plan.mirror else path)  # a mirror's: where the files are
    return scripts


def upload(plan: Plan) -> None:
    """Copy what write() rendered to the head node, and create the log directories Slurm writes into."""
    runner = remote.current()
    for job in plan.jobs:
        runner.makedirs(PurePosixPath(job.log_dir))
    for here, there, mode in plan.files:
        runner.put(here, str(there), mode)


def config_hash(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_record(plan: Plan, scripts: list[Path]) -> dict[str, Any]:
    return {
        "run_name": plan.config.run_name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "executor": plan.executor,
        "command": plan.produced_by,
        "config_hash": config_hash(plan.cfg),
        "stages": [
            {
                "stage": job.stage,
                "job_id": None,
                "script": str(script),
                "config": str(job.config_path),
                "log_dir": str(job.log_dir),
                "nodes": job.nodes,
                "tasks_per_node": job.nproc_per_node,
                "array_size": job.array_size,
                "dependency": job.dependency if i else None,
                "exit_code": None,
            }
            for i, (job, script) in enumerate(zip(plan.jobs, scripts))
        ],
    }


def submit_slurm(plan: Plan, scripts: list[Path], record: dict[str, Any]) -> None:
    """sbatch each stage after the previous one. If Slurm refuses a stage, the stages already submitted are
    cancelled, so a half-submitted pipeline never runs. A remote launch first copies its files over."""
    remote.use(plan.remote)
    if plan.remote:
        upload(plan)
    submitted: list[str] = []
    try:
        for job, script, entry in zip(plan.jobs, scripts, record["stages"]):
            after = submitted[-1] if submitted else None
            submitted.append(slurm.submit(script, dependency=job.dependency, after=after))
            entry["job_id"] = submitted[-1]
    except slurm.SlurmError:
        slurm.cancel(submitted)
        raise
    if plan.remote is None:
        records.archive_previous(plan.run_dir)
        records.write(plan.run_dir, record)
        return
    # On the head node, a plain Slurm record (status works there too); here, one that names the remote.
    _archive_remote_record(plan.run_dir)
    remote_copy = plan.local_path(plan.run_dir)
    records.write(remote_copy, record)
    remote.current().put(remote_copy / records.RECORD, str(plan.run_dir / records.RECORD))
    here = records.remote_runs_dir() / plan.config.run_name
    records.archive_previous(here)
    records.write(here, {**record, "remote": plan.remote})


def _archive_remote_record(run_dir: Path) -> None:
    runner = remote.current()
    path = str(run_dir / records.RECORD)
    try:
        created = json.loads(runner.read_text(path)).get("created", "old").replace(":", "")
    except (OSError, ValueError):
        return
    runner.rename(path, str(run_dir / f"launch.{created}.json"))


def run_local(plan: Plan, scripts: list[Path], record: dict[str, Any], console) -> int:
    """Run the stages in order on this machine, streaming their output; stop at the first failure.
    Returns the exit code of the last stage run."""
    records.archive_previous(plan.run_dir)
    record["pid"] = os.getpid()
    record["pid_started"] = runs.process_started(os.getpid())  # `cancel` and `status` tell a reused pid by it
    records.write(plan.run_dir, record)
    code = 0
    for i, (job, script, entry) in enumerate(zip(plan.jobs, scripts, record["stages"]), start=1):
        console.rule(f"[bold]{job.stage}[/] ({i}/{len(plan.jobs)})")
        started = time.monotonic()
        proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        entry["job_id"] = "local"
        entry["pid"] = proc.pid  # `cancel` signals this stage's processes through it; `status` shows it
        records.write(plan.run_dir, record)
        try:
            with console.status(f"{job.stage} running"):
                for line in proc.stdout:
                    console.out(line.rstrip("\n"), highlight=False)
            code = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait()
        entry["exit_code"] = code
        records.write(plan.run_dir, record)
        took = time.monotonic() - started
        if code != 0 and job.stage in records.cancelled_stages(plan.run_dir, record):
            console.print(f"{job.stage} cancelled (exit {code}) after {took:.0f}s; log: {job.log_dir}",
                          highlight=False)
            break
        if code != 0:
            console.print(f"[red]{job.stage} failed with exit code {code} after {took:.0f}s[/]; "
                          f"log: {job.log_dir}", markup=True, highlight=False)
            break
        console.print(f"[green]{job.stage} done[/] in {took:.0f}s")
    record.pop("pid", None)
    records.write(plan.run_dir, record)
    return code
