"""pytest fixture `slurm_cluster`: the real three-node Slurm of csp_tools/local_slurm, once per test session.

Register it from tests/conftest.py with `pytest_plugins = ["tests.slurm_cluster"]`. Then:

    @pytest.mark.slurm
    def test_something(slurm_cluster, tmp_path):
        job = subprocess.run(["sbatch", "--parsable", "--wrap", "true"], env=slurm_cluster.env, cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout.split(";")[0]
        assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"

Without Slurm installed the fixture skips, except under CI (env CI set), where a missing cluster must fail.
NXDT_SLURM_ROOT picks the state directory (default /tmp/nxdt-slurm). A cluster that was already up and healthy
when the session started is reused and left up; one the fixture started is taken down at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from csp_tools.local_slurm import DEFAULT_ROOT, LocalSlurm


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to use the cluster; `env` is os.environ plus SLURM_CONF (pass it to every client)."""

    cluster: LocalSlurm
    env: dict[str, str] = field(repr=False)

    @property
    def root(self) -> Path:
        return self.cluster.root

    @property
    def nodes(self) -> list[str]:
        return self.cluster.nodes

    @property
    def partition(self) -> str:
        return self.cluster.partition

    def wait_job(self, job_id: int | str, timeout: float = 60.0) -> str:
        """Final state (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...) once the job left the queue."""
        return self.cluster.wait_job(job_id, timeout=timeout)

    def wait_idle(self, timeout: float = 300.0) -> None:
        """Until no job is queued, running or completing: a test about where Slurm places its tasks starts on free
        nodes, not beside what an earlier test's jobs still hold."""
        deadline = time.monotonic() + timeout
        while (queue := subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True,
                                       text=True, check=True).stdout.strip()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster still holds jobs after {timeout:.0f}s: {queue}")
            time.sleep(0.5)

    def job_info(self, job_id: int | str) -> list[dict[str, str]]:
        """`scontrol show job` fields, one dict per record (array tasks are separate records)."""
        return self.cluster.job_info(job_id)


def _unavailable_reason() -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [name for name in ("slurmctld", "slurmd", "munged") if shutil.which(name, path=path) is None]
    if missing:
        return f"{', '.join(missing)} not installed (run csp_tools/local_slurm/install.sh as root)"
    if os.geteuid() != 0:
        return "the local Slurm cluster must be started as root"
    return None


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = _unavailable_reason()
    if reason is not None:
        if _in_ci():
            pytest.fail(f"CI is set but the local Slurm cluster cannot start: {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = LocalSlurm(root=Path(os.environ.get("NXDT_SLURM_ROOT", DEFAULT_ROOT)).resolve())
    started = cluster.up(timeout=60)
    try:
        yield SlurmCluster(cluster=cluster, env=cluster.env())
    finally:
        if started:
            cluster.down()
