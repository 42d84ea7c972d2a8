"""What a k8s pod runs besides the node script's program (docs/kubernetes.md): this nxdt-launch's code, which the
launch copies onto the shared volume (code_dir), and the packages a pod installs into its image before the program
(runtime_requirements, cluster.k8s.install_requirements). launcher/k8s.py renders both into each manifest."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.job import Job

if TYPE_CHECKING:
    from launcher.config import LaunchConfig


# The packages a launch's stages may need beyond the runtime extra (launcher/packages.py names them by module), and
# the extra of pyproject.toml that holds each (wandb is in none but the test extra: its name).
EXTRA_OF_MODULE = {"lm_eval": "eval", "pyarrow": "parquet"}


def _extras() -> dict[str, list[str]]:
    """pyproject.toml's optional dependencies of the code the launch copies, or of the installed nxdt-launch."""
    import tomllib

    from launcher.errors import UserError
    from launcher.render import code_root

    pyproject = Path(code_root()) / "pyproject.toml"
    if pyproject.is_file():
        return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    from importlib.metadata import PackageNotFoundError, requires

    try:
        found: dict[str, list[str]] = {}
        for line in requires("nxdt-launch") or []:
            spec, _, marker = line.partition(";")
            if extra := re.search(r"""extra\s*==\s*["'](\w+)["']""", marker):
                found.setdefault(extra.group(1), []).append(spec)
        return found
    except PackageNotFoundError:
        raise UserError("cluster.k8s.install_requirements: this nxdt-launch is neither a checkout nor installed, so "
                        "the runtime's requirements are unknown; pip install nxdt-launch, or set "
                        "cluster.k8s.install_requirements=false with an image that has them") from None


def runtime_requirements(cfg: LaunchConfig) -> list[str]:
    """What a pod installs before the program (cluster.k8s.install_requirements): the runtime extra's requirements of
    the code the launch copies, but torch, which the image brings built for its devices (Neuron, CUDA); then what
    this launch's stages need beyond it (lm-evaluation-harness for its tasks, pyarrow for parquet inputs, wandb for
    its logger: launcher/packages.py)."""
    from launcher.packages import needed

    extras = _extras()
    lines = [spec for spec in extras["runtime"] if not re.match(r"torch\b", spec.strip())]
    for module in dict.fromkeys(module for module, _, _ in needed(cfg)):
        if module in EXTRA_OF_MODULE:
            lines += extras.get(EXTRA_OF_MODULE[module], [])
        elif module == "wandb":
            lines.append("wandb")
    return [spec.strip().replace(" ", "") for spec in dict.fromkeys(lines)]


def code_dir(job: Job) -> Path:
    """Where the launch puts this nxdt-launch's runtime/ and csp_tools/ for the stage's pods (launch.write), first on
    their PYTHONPATH: beside the stage config, in the launch's own directory, so a running job keeps the code it was
    submitted with."""
    return (job.config_dir or job.results_dir) / "code"
