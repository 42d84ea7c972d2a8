"""The OmegaConf resolvers NeMo-Launcher's configs use (${multiply:...}, ${cwd:}, ...), registered before any
config is loaded: by compose.py for the launch config, by nxdt_config.py for a training file given as @FILE.
A module of its own so that neither of those has to import the other.

What the resolvers read from outside the config is known to the launch cache (launcher/cache.py): the
working directory is part of its key, and the environment variables that ${oc.env:NAME} reads are recorded while
a config composes and resolves (recording_env), so that an entry is used only while they hold the same values."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

# NAME -> its value (None: unset) for every ${oc.env:NAME} read while recording_env() is open; None otherwise.
_env_reads: dict[str, str | None] | None = None


def _divide_ceil(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def trained_key(stages, root, key: str, here: bool) -> str | None:
    """The key that `${trained:KEY}` (here=False) or `${trained_here:KEY}` (here=True) reads: KEY under the last stage
    of `stages` (the launch's `stages`, a list; anything else lists none) that trains (training, fine_tuning, peft or
    alignment) and is in `root`, so the conversion, the evaluation and the run's name follow the model this launch
    ends with: a fine-tuning launch converts and evaluates its fine-tuned checkpoints,
    stages=[fine_tuning,alignment,conversion] its aligned ones. With no such stage, `trained` reads training's and
    `trained_here` nothing (None): a conversion or evaluation alone takes what its checkpoint recorded (an imported
    model's own tokenizer) rather than a recipe's default it never trained with. Shared by OmegaConf's resolvers here
    and launcher/plain_resolve.py."""
    from launcher.stages import TRAINER_STAGES  # stages.py imports nothing of the launcher's but job.py

    listed = stages if isinstance(stages, list) else []
    stage = next((s for s in reversed(listed) if s in TRAINER_STAGES and s in root), None)
    if stage is None:
        return None if here else f"training.{key}"
    return f"{stage}.{key}"


def _listed(root) -> list:
    """The launch's `stages` as a list (a malformed `stages` is validate.py's to name)."""
    from omegaconf import OmegaConf

    stages = root.get("stages")
    return list(stages) if OmegaConf.is_list(stages) else []


def _trained(key: str, *, _root_):
    """`${trained:run.results_dir}`: that key of the last stage of this launch that trains (trained_key)."""
    from omegaconf import OmegaConf

    return OmegaConf.select(_root_, trained_key(_listed(_root_), _root_, key, here=False))


def _trained_here(key: str, *, _root_):
    """`${trained_here:model.tokenizer.model}`: as `trained`, but null when this launch runs no stage that trains."""
    from omegaconf import OmegaConf

    path = trained_key(_listed(_root_), _root_, key, here=True)
    return None if path is None else OmegaConf.select(_root_, path)


def shared_dir(name: str, cluster_type, mount_path) -> str:
    """`${shared_dir:results}`: NAME on the file system every node of the cluster shares, as this machine sees it: the
    launch's working directory (a Slurm head node's shared home or /fsx; this machine for a local launch), or on
    cluster_type=k8s the mount path of the pods' shared volume (cluster.k8s.volume.mount_path), where the launch must
    run as on a head node (docs/kubernetes.md). Shared by OmegaConf's resolver here and launcher/plain_resolve.py."""
    root = mount_path if cluster_type == "k8s" and isinstance(mount_path, str) and mount_path else os.getcwd()
    return f"{root.rstrip('/') or ''}/{name}"


def _shared_dir(name: str, *, _root_):
    from omegaconf import OmegaConf

    return shared_dir(str(name), OmegaConf.select(_root_, "cluster_type"),
                      OmegaConf.select(_root_, "cluster.k8s.volume.mount_path", default=None))


def _env(key, *default):
    """OmegaConf's own ${oc.env:NAME[,DEFAULT]}, unchanged, noting which variable it read and what it held."""
    from omegaconf.resolvers.oc import env

    if _env_reads is not None:
        _env_reads[str(key)] = os.environ.get(str(key))
    return env(key, *default)


@contextmanager
def recording_env() -> Iterator[dict[str, str | None]]:
    """The environment variables ${oc.env:...} reads inside the block, as {NAME: value or None when unset}."""
    global _env_reads
    reads: dict[str, str | None] = {}
    previous, _env_reads = _env_reads, reads
    try:
        yield reads
    finally:
        _env_reads = previous


# The resolvers that compute from their arguments alone: OmegaConf's (register_resolvers) and
# launcher/plain_resolve.py's.
FUNCTIONS = {
    "multiply": lambda *xs: math.prod(xs),
    "divide_ceil": _divide_ceil,
    "divide_floor": lambda a, b: int(a) // int(b),
    "cwd": os.getcwd,
}


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    resolvers = {**FUNCTIONS, "trained": _trained, "trained_here": _trained_here, "shared_dir": _shared_dir,
                 "oc.env": _env}
    for name, fn in resolvers.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)
