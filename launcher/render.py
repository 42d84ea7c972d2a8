"""Render a Job into a job script. Pure: the same job and config always give the same text, and nothing is
written here. Every config value reaches the shell through the `q` filter (shlex.quote) or, inside a
comment, through `comment`, which keeps it on one line."""

from __future__ import annotations

import re
import shlex
import sys
from functools import lru_cache
from typing import Any

from launcher import neuron, remote, staging
from launcher.job import Job
from launcher.paths import templates_dir
from launcher.validate import SBATCH_KEYS
from runtime.io import s3
from runtime.schema.s3 import parse_s3

TEMPLATES = {"slurm": "sbatch.sh.j2", "local": "local.sh.j2"}


def _quote(value: Any) -> str:
    return shlex.quote(str(value))


def _comment(value: Any) -> str:
    # A newline inside a comment would start a shell line of its own.
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


@lru_cache(maxsize=1)
def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = _quote
    env.filters["comment"] = _comment
    return env


def job_name(cfg: dict[str, Any], job: Job) -> str:
    prefix = (cfg.get("cluster") or {}).get("job_name_prefix") or ""
    return re.sub(r"[^A-Za-z0-9_.:+-]", "_", f"{prefix}{job.run_name}:{job.stage}")


def sbatch_options(cluster: dict[str, Any]) -> list[str]:
    """The cluster group's Slurm settings as `#SBATCH --<option>` bodies, in a fixed order."""
    options = []
    for key in SBATCH_KEYS:
        value = cluster.get(key)
        if value is None or value is False or value == []:
            continue
        if value is True:
            options.append(key)
        else:
            options.append(f"{key}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return options


def job_env(cfg: dict[str, Any]) -> dict[str, str]:
    """Cluster environment first, then the launch's env_vars, which win."""
    env = dict((cfg.get("cluster") or {}).get("env_vars") or {})
    env.update(cfg.get("env_vars") or {})
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def s3_env(cfg: dict[str, Any]) -> dict[str, str]:
    """cluster.s3 as the NXDT_S3_* variables every S3 client of the stage is made from (runtime/io/s3.py)."""
    settings, report = parse_s3((cfg.get("cluster") or {}).get("s3"))
    report.raise_if_any()  # validate.problems has reported these before anything is rendered
    return s3.to_env(settings)


def srun_args(cfg: dict[str, Any]) -> list[str]:
    args = [str(a) for a in (cfg.get("cluster") or {}).get("srun_args") or []]
    if cfg.get("container"):
        args.append(f"--container-image={cfg['container']}")
        if cfg.get("container_mounts"):
            args.append(f"--container-mounts={','.join(map(str, cfg['container_mounts']))}")
    return args


def python(cfg: dict[str, Any]) -> str:
    """The interpreter the scripts run: the configured one, else `python3` where this machine's cannot be seen
    (in a container, on a remote head node), else the one running nxdt-launch."""
    if cfg.get("python"):
        return str(cfg["python"])
    return "python3" if cfg.get("container") or remote.settings(cfg) else sys.executable


def render(job: Job, cfg: dict[str, Any], *, executor: str, produced_by: str) -> str:
    """`cfg` is the resolved config as composed (S3 URLs and all); `job` comes from launch.build."""
    cluster = cfg.get("cluster") or {}
    template = _environment().get_template(TEMPLATES[executor])
    return template.render(
        neuron=neuron.script(job, cfg),
        master_port_base=neuron.MASTER_PORT_BASE,
        master_port_span=neuron.MASTER_PORT_SPAN,
        compile_summary=neuron.COMPILE_SUMMARY,
        staging=staging.for_job(job, cfg),
        job=job,
        produced_by=produced_by,
        job_name=job_name(cfg, job),
        sbatch_options=sbatch_options(cluster),
        srun_args=srun_args(cfg),
        setup=[str(line) for line in cluster.get("setup") or []],
        env=job_env(cfg),
        s3_env=s3_env(cfg),
        python=python(cfg),
    )
