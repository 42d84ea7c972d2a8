"""Render a Job into a job script. Pure: the same job and config always give the same text, and nothing is
written here. Every config value reaches the shell through the `q` filter (shlex.quote) or, inside a
comment, through `comment`, which keeps it on one line."""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any

from launcher import instances, neuron, paths, remote, staging
from launcher.config import SBATCH_KEYS, Cluster, LaunchConfig, typed
from launcher.job import Job
from launcher.paths import templates_dir
from runtime.io import s3
from runtime.schema.facts import PREEMPTED_EXIT_CODE
from runtime.schema.s3 import parse_s3

# k8s: the script every pod runs; launcher/k8s.py puts it into the stage's manifest.
TEMPLATES = {"slurm": "sbatch.sh.j2", "local": "local.sh.j2", "k8s": "k8s/node.sh.j2"}


def _quote(value: Any) -> str:
    return shlex.quote(str(value))


def _comment(value: Any) -> str:
    # A newline inside a comment would start a shell line of its own.
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


@lru_cache(maxsize=1)
def _environment():
    import jinja2

    from launcher.cache import template_cache

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        bytecode_cache=template_cache(__file__),  # compiled once per template text, not per launch
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = _quote
    env.filters["comment"] = _comment
    env.filters["y"] = json.dumps  # YAML (templates/k8s/): a JSON scalar is a YAML flow scalar, quoted as needed
    return env


def job_name(cfg: LaunchConfig, job: Job) -> str:
    prefix = cfg.cluster.job_name_prefix or ""
    return re.sub(r"[^A-Za-z0-9_.:+-]", "_", f"{prefix}{job.run_name}:{job.stage}")


def sbatch_options(cluster: Cluster) -> list[str]:
    """The cluster group's Slurm settings as `#SBATCH --<option>` bodies, in a fixed order."""
    options = []
    for key in SBATCH_KEYS:
        value = cluster.sbatch.get(key)
        if value is None or value is False or value == []:
            continue
        if value is True:
            options.append(key)
        else:
            options.append(f"{key}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return options


def job_env(cfg: LaunchConfig) -> dict[str, str]:
    """Cluster environment first, then the launch's env_vars, which win."""
    env = dict(cfg.cluster.env_vars or {})
    env.update(cfg.env_vars or {})
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def s3_env(cfg: LaunchConfig | dict[str, Any]) -> dict[str, str]:
    """cluster.s3 as the NXDT_S3_* variables every S3 client of the stage is made from (runtime/io/s3.py)."""
    settings, report = parse_s3(typed(cfg).cluster.s3)
    report.raise_if_any()  # validate.problems has reported these before anything is rendered
    return s3.to_env(settings)


# The packages job programs import (`-m runtime.train`, `-m csp_tools.cluster_validate`): mounted into a
# container read-only, so that an image with the runtime's dependencies runs this checkout's code.
CODE_PACKAGES = ("runtime", "csp_tools")


def code_root() -> PurePosixPath:
    """The directory that holds CODE_PACKAGES here: a checkout, or site-packages of an installed nxdt-launch."""
    return PurePosixPath(paths.REPO_ROOT)


@dataclass(frozen=True)
class Container:
    """A stage run under Pyxis/enroot (`container=IMAGE` on Slurm): every srun step of the job runs in it.
    Paths keep their names inside (every mount is SRC:SRC), so the stage config, the logs and PYTHON's
    arguments mean the same on both sides."""

    image: str
    mounts: list[str]       # --container-mounts entries: the automatic ones, then container_mounts
    workdir: str            # --container-workdir: the stage's results directory
    code_root: str          # put first on PYTHONPATH inside the container
    make_dirs: list[str]    # mount sources the job creates first: Pyxis refuses a source that does not exist

    @property
    def srun_args(self) -> list[str]:
        return [f"--container-image={self.image}", f"--container-mounts={','.join(self.mounts)}",
                f"--container-workdir={self.workdir}"]


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def container(job: Job, cfg: LaunchConfig | dict[str, Any]) -> Container | None:
    """What the job needs inside its container, or None without one. Mounted automatically, as NeMo-Launcher
    mounts its results, data and launcher directories: the code (read-only), base_results_dir (and the stage's
    results directory when it lies elsewhere), data_dir (its staging mirror when it is on S3), and a compile
    cache directory; then each `container_mounts` entry (SRC:DST[:FLAGS]) as given."""
    cfg = typed(cfg)
    if not cfg.container:
        return None
    code = code_root()
    mounts = [f"{code / package}:{code / package}:ro" for package in CODE_PACKAGES]
    dirs = [str(cfg.base_results_dir).rstrip("/")]
    if not _under(str(job.results_dir), dirs):
        dirs.append(str(job.results_dir))
    data_dir = str(cfg.data_dir or "")
    local_mirror = cfg.cluster.staging_local_dir
    if data_dir.startswith("/"):
        dirs.append(data_dir.rstrip("/"))
    elif local_mirror:
        dirs.append(str(local_mirror).rstrip("/"))
    script = neuron.script(job, cfg)
    if script and not script.cache_url.startswith("s3://"):
        dirs.append(neuron.cache_location(cfg))
    dirs = [d for i, d in enumerate(dirs) if not _under(d, dirs[:i])]  # one mount per tree
    mounts += [f"{d}:{d}" for d in dirs] + [str(m) for m in cfg.container_mounts or []]
    return Container(image=str(cfg.container), mounts=list(dict.fromkeys(mounts)), workdir=str(job.results_dir),
                     code_root=str(code), make_dirs=dirs)


def srun_args(cfg: LaunchConfig, inside: Container | None) -> list[str]:
    args = [str(a) for a in cfg.cluster.srun_args or []]
    return args + (inside.srun_args if inside else [])


def venv(cfg: LaunchConfig) -> str | None:
    """cluster.venv, the venv every node of the cluster has (the ParallelCluster node script makes it): the job
    activates it. Not in a container, whose image brings its own Python."""
    path = cfg.cluster.venv
    return None if not path or cfg.container else str(path).rstrip("/")


def python(cfg: LaunchConfig | dict[str, Any]) -> str:
    """The interpreter the scripts run: `python` when the launch names one; `python3` in a container or a k8s pod (the
    image's); the cluster's venv (cluster.venv) when it has one; `python3` on a remote head node, whose paths
    this machine cannot see; and only then the one running nxdt-launch, whose path the job can see as well
    (this machine, or a Slurm cluster whose venv is on the shared file system)."""
    cfg = typed(cfg)
    if cfg.python:
        return str(cfg.python)
    if cfg.container or cfg.cluster_type == "k8s":
        return "python3"
    if venv(cfg):
        return f"{venv(cfg)}/bin/python"
    return "python3" if remote.settings(cfg) else sys.executable


def render(job: Job, cfg: LaunchConfig | dict[str, Any], *, executor: str, produced_by: str,
           k8s: dict[str, Any] | None = None) -> str:
    """`cfg` is the resolved config as composed (S3 URLs and all); `job` comes from launch.build. For executor k8s,
    the script every pod of the stage's manifest runs, `k8s` the pod's code_dir and requirements (launcher/k8s.py
    manifest)."""
    cfg = typed(cfg)
    template = _environment().get_template(TEMPLATES[executor])
    # On Kubernetes the pod is the container (the manifest names the image): no Pyxis steps in the script.
    inside = container(job, cfg) if executor != "k8s" else None
    neuron_script = neuron.script(job, cfg)
    return template.render(
        k8s=k8s,
        neuron=neuron_script,
        fabric=neuron.fabric(job, cfg),
        container=inside,
        venv=venv(cfg),
        # torchrun's rendezvous port range on a Slurm node (Trainium nodes reserve theirs), and the port a pod's
        # torchrun falls back to when the training operator sets none.
        rendezvous=instances.NEURON_RENDEZVOUS if neuron_script else instances.SLURM_RENDEZVOUS,
        torchrun_default_port=instances.TORCHRUN_DEFAULT_PORT,
        compile_summary=neuron.COMPILE_SUMMARY,
        staging=staging.for_job(job, cfg),
        job=job,
        produced_by=produced_by,
        job_name=job_name(cfg, job),
        sbatch_options=sbatch_options(cfg.cluster),
        srun_args=srun_args(cfg, inside),
        setup=[str(line) for line in cfg.cluster.setup or []],
        env=job_env(cfg),
        s3_env=s3_env(cfg),
        python=python(cfg),
        preempted_exit_code=PREEMPTED_EXIT_CODE,
        hyperpod=cfg.cluster.hyperpod is True,
    )
