"""A launch, in three steps that the CLI calls in order: plan (compose + validate + build jobs; pure apart
from reading conf/), write (stage configs and scripts; the only files a dry run leaves), and submit or run
(the side effect). Nothing is written unless the plan is valid."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from launcher import records, slurm, validate
from launcher.compose import compose, resolve
from launcher.errors import UserError
from launcher.job import Job
from launcher.render import render
from launcher.stages import build_jobs


@dataclass
class Plan:
    cfg: dict[str, Any]
    executor: str                # slurm | local
    executor_reason: str         # why: shown in the table's title
    jobs: list[Job]
    warnings: list[str]
    produced_by: str
    dry_run: bool

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg["base_results_dir"]) / self.cfg["run_name"]


def choose_executor(cluster_type: str) -> tuple[str, str]:
    if cluster_type in ("slurm", "bcm"):
        return "slurm", f"cluster_type={cluster_type}"
    if cluster_type == "local":
        return "local", "cluster_type=local"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if shutil.which("sbatch") and Path(conf).exists():
        return "slurm", f"cluster_type=auto: sbatch and {conf} found"
    return "local", "cluster_type=auto: no Slurm here"


def make_plan(overrides: list[str], *, dry_run: bool, produced_by: str) -> Plan:
    cfg = resolve(compose(overrides))
    dry_run = dry_run or bool(cfg.get("dry_run"))
    errors, warnings = validate.problems(cfg, dry_run=dry_run)
    executor, reason = choose_executor(str(cfg.get("cluster_type")))
    if executor == "local" and cfg.get("container"):
        errors.append("container: the local executor runs this machine's Python; set container=null "
                      "or use cluster_type=slurm")
    if errors:
        raise UserError(*errors)
    return Plan(cfg, executor, reason, build_jobs(cfg), warnings, produced_by, dry_run)


def script_path(job: Job, executor: str) -> Path:
    return job.results_dir / (f"{job.stage}.sbatch" if executor == "slurm" else f"{job.stage}.local.sh")


def write(plan: Plan) -> list[Path]:
    import yaml

    scripts = []
    for job in plan.jobs:
        text = render(job, plan.cfg, executor=plan.executor, produced_by=plan.produced_by)
        # Slurm opens #SBATCH --output before the script runs: the log directory must exist at submit time.
        job.log_dir.mkdir(parents=True, exist_ok=True)
        job.config_path.write_text(yaml.safe_dump(job.stage_config, sort_keys=False))
        path = script_path(job, plan.executor)
        path.write_text(text)
        path.chmod(0o755)
        scripts.append(path)
    return scripts


def config_hash(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_record(plan: Plan, scripts: list[Path]) -> dict[str, Any]:
    return {
        "run_name": plan.cfg["run_name"],
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
    cancelled, so a half-submitted pipeline never runs."""
    submitted: list[str] = []
    try:
        for job, script, entry in zip(plan.jobs, scripts, record["stages"]):
            after = submitted[-1] if submitted else None
            submitted.append(slurm.submit(script, dependency=job.dependency, after=after))
            entry["job_id"] = submitted[-1]
    except slurm.SlurmError:
        slurm.cancel(submitted)
        raise
    records.archive_previous(plan.run_dir)
    records.write(plan.run_dir, record)


def run_local(plan: Plan, scripts: list[Path], record: dict[str, Any], console) -> int:
    """Run the stages in order on this machine, streaming their output; stop at the first failure.
    Returns the exit code of the last stage run."""
    records.archive_previous(plan.run_dir)
    record["pid"] = os.getpid()
    records.write(plan.run_dir, record)
    code = 0
    for i, (job, script, entry) in enumerate(zip(plan.jobs, scripts, record["stages"]), start=1):
        entry["job_id"] = "local"
        console.rule(f"[bold]{job.stage}[/] ({i}/{len(plan.jobs)})")
        started = time.monotonic()
        proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
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
        if code != 0:
            console.print(f"[red]{job.stage} failed with exit code {code} after {took:.0f}s[/]; "
                          f"log: {job.log_dir}", markup=True, highlight=False)
            break
        console.print(f"[green]{job.stage} done[/] in {took:.0f}s")
    record.pop("pid", None)
    records.write(plan.run_dir, record)
    return code
