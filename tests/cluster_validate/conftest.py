"""Helpers shared by the cluster validation tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
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
    in a process forked from this one, where torch is already imported (a fresh interpreter would import it again):
    the agent's own process (its environment updated with `env`, its stdout and stderr, its control store, threads,
    worker processes and exit code), a copy of this one in all else. For the tests whose subject is what the agent
    does and reports; test_cli.py's local run and test_netns.py start it as its job script does."""
    import torch.distributed as dist

    from csp_tools.cluster_validate.node import main

    assert not dist.is_initialized(), "a forked agent would inherit this process's group"
    argv = ["--config", str(config)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.environ.update(env or {})
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        deadline = time.monotonic() + timeout
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(["csp_tools.cluster_validate", *argv], timeout)
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(done[1]), stdout, stderr)
