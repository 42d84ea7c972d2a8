"""Helpers shared by the cluster validation tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher.compose import compose, resolve


def write_stage_config(tmp_path: Path, *overrides: str) -> Path:
    """The file `nxdt-launch cluster-validate` would write for these overrides (keys of the group, unprefixed)."""
    from launcher.commands.cluster_validate import with_group_prefix

    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "results").mkdir(exist_ok=True)
    cfg = resolve(compose([f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data",
                           *(with_group_prefix(o) for o in overrides)]))
    path = tmp_path / "cluster_validation_config.yaml"
    path.write_text(yaml.safe_dump({**cfg["cluster_validation"], "launch": {"cluster_exclude": []}}))
    return path


@pytest.fixture
def stage_config(tmp_path):
    return lambda *overrides: write_stage_config(tmp_path, *overrides)


def agent_here(config: Path, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m csp_tools.cluster_validate --config CONFIG` (the command the launcher's script runs), its main run
    in a process forked from this one (tests/launcher/helpers.run_forked), where torch is already imported (a fresh
    interpreter would import it again): the agent's own process (this environment updated with `env`, its stdout
    and stderr, its control store, threads, worker processes and exit code), a copy of this one in all else. For
    the tests whose subject is what the agent does and reports; test_cli.py's local run and test_netns.py start it
    as its job script does."""
    import torch.distributed as dist

    from csp_tools.cluster_validate.node import main
    from tests.launcher.helpers import run_forked

    assert not dist.is_initialized(), "a forked agent would inherit this process's group"
    argv = ["--config", str(config)]
    return run_forked(lambda: main(argv), ["python", "-m", "csp_tools.cluster_validate", *argv],
                      environ={**os.environ, **(env or {})}, timeout=timeout)
