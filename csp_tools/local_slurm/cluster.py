"""A real three-node Slurm cluster (node1-node3, one partition) on this one machine, for tests and trying the tool.

Three nodes, so that a 2-node job can lose one and still find two to run on.

Three slurmd on one host: Debian's Slurm is built with --enable-multiple-slurmd (`scontrol show config` lists
MULTIPLE_SLURMD = Yes), so each slurmd is started as `slurmd -N <node>` and the nodes differ only by Port= on
127.0.0.1; %n in the spool, pid and log paths keeps their files apart. No network namespaces or veth pairs are
needed, which also keeps this working in containers that may not create them.

Everything lives under one root directory (state, spool, pid files, logs, slurm.conf); clients reach the
cluster through SLURM_CONF (see `LocalSlurm.env`), and /etc/slurm is never touched.

    python -m csp_tools.local_slurm up        # as root; waits until every node is idle
    export SLURM_CONF=/tmp/nxdt-slurm/slurm.conf && srun -N3 -n3 hostname
    python -m csp_tools.local_slurm down
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

from csp_tools.local_slurm import munge, procs

DEFAULT_ROOT = Path("/tmp/nxdt-slurm")
NODES = ("node1", "node2", "node3")
TEMPLATE = Path(__file__).with_name("slurm.conf.template")

# A job in one of these states will not run again (a requeued job passes through PENDING, not these).
TERMINAL_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
     "TIMEOUT"}
)
# sinfo's short states for a node that can take (or is running) work; a suffix such as '*' means trouble.
_USABLE_NODE_STATES = frozenset({"idle", "mix", "alloc", "comp"})
# Subdirectories `down` may delete: only what `up` creates, so a mistaken --root cannot wipe anything else.
_OWNED_DIRS = ("state", "spool", "run", "munge")


class ClusterError(RuntimeError):
    """The local cluster could not be brought up, or a job could not be followed."""


@dataclass(frozen=True, kw_only=True)
class LocalSlurm:
    root: Path = DEFAULT_ROOT
    partition: str = "debug"
    # Per node. More than this 2-core machine has: oversubscription is fine and leaves room for job arrays.
    cpus: int = 4
    memory_mb: int = 4096
    # slurmctld listens on port_base, node1-node3 on the next three; away from Slurm's default 6817-6818.
    port_base: int = 16817

    @property
    def conf_path(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        return list(NODES)

    def env(self) -> dict[str, str]:
        """os.environ for Slurm clients of this cluster.

        SLURM_* job variables inherited from an enclosing allocation are dropped: srun would otherwise try to
        run inside that job id on our cluster.
        """
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    def render_conf(self) -> str:
        return Template(TEMPLATE.read_text()).substitute(
            root=self.root,
            partition=self.partition,
            cpus=self.cpus,
            memory_mb=self.memory_mb,
            ctld_port=self.port_base,
            **{f"{node}_port": self.port_base + index for index, node in enumerate(NODES, start=1)},
        )

    # ---- lifecycle -------------------------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> bool:
        """Start munge, slurmctld and a slurmd per node; wait until every node is idle.

        Returns False if a healthy cluster with this configuration was already running (it is left as is),
        True if it was (re)started. Anything half-running is taken down first.
        """
        if any(char.isspace() for char in str(self.root)):
            raise ClusterError(f"root {str(self.root)!r} contains whitespace, which slurm.conf cannot quote")
        if os.geteuid() != 0:
            raise ClusterError("the local Slurm cluster must be started as root (it runs munged and slurmd)")
        for name in ("slurmctld", "slurmd", "sinfo", "munged", "munge"):
            procs.binary(name)
        if self.healthy():
            return False
        self.down()
        try:
            self._start(timeout)
        except BaseException:
            self.down()  # logs are kept: the error message already quotes them
            raise
        return True

    def _start(self, timeout: float) -> None:
        for sub in ("state", "run", *(f"spool/{node}" for node in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.root / "log", ignore_errors=True)
        (self.root / "log").mkdir()
        self.conf_path.write_text(self.render_conf())
        deadline = time.monotonic() + timeout

        munge.start(self.root / "munge")
        # -c: start from empty state, so job ids and node states never leak from an earlier session.
        self._daemon("slurmctld", ["-c"])
        self._wait_for(self._controller_up, deadline, "slurmctld did not answer `scontrol ping`", ["slurmctld"])
        for node in NODES:
            self._daemon(f"slurmd-{node}", ["-N", node])
        self._wait_for(
            lambda: self.node_states() == {node: "idle" for node in NODES},
            deadline,
            "the nodes did not all become idle",
            ["slurmctld", *(f"slurmd-{node}" for node in NODES)],
        )

    def _daemon(self, name: str, args: list[str]) -> None:
        program = name.split("-")[0]
        # stderr goes to a file, not a pipe: the daemon forks, and a pipe it kept open would hang run().
        with open(self.root / "log" / f"{name}.stderr", "wb") as stderr:
            result = subprocess.run(
                [procs.binary(program), "-f", str(self.conf_path), *args],
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                timeout=30,
            )
        if result.returncode != 0:
            raise ClusterError(f"{name} exited with {result.returncode}\n{self.logs()}")

    def _wait_for(self, condition, deadline: float, what: str, daemons: list[str]) -> None:
        # A daemon that died (say, its port was taken) will not come back: say so now, not at the deadline.
        # The grace period covers the moment between its fork and its writing the pid file.
        grace_end = time.monotonic() + 3.0
        while not condition():
            dead = [name for name in daemons if not self._daemon_alive(name)]
            if dead and time.monotonic() > grace_end:
                raise ClusterError(f"{what}: {', '.join(dead)} exited\n{self.logs()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} in time; sinfo: {self.node_states()}\n{self.logs()}")
            time.sleep(0.25)

    def down(self) -> None:
        """Cancel every job, stop the daemons this root's pid files name, and delete all but the logs."""
        if self._daemon_alive("slurmctld"):
            self._cancel_all_jobs()
        for node in NODES:
            procs.stop(self.root / "run" / f"slurmd-{node}.pid", "slurmd")
        procs.stop(self.root / "run" / "slurmctld.pid", "slurmctld")
        for pid in procs.job_processes_of(self.conf_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        munge.stop(self.root / "munge")
        if (self.root / "munge" / "munged.log").exists():  # munge/ goes below; keep its log with the others
            shutil.copy(self.root / "munge" / "munged.log", self.root / "log" / "munged.log")
        for sub in _OWNED_DIRS:
            shutil.rmtree(self.root / sub, ignore_errors=True)
        self.conf_path.unlink(missing_ok=True)

    def _cancel_all_jobs(self, timeout: float = 10.0) -> None:
        # Cancelling lets each slurmstepd kill its own tasks; killing slurmd first would orphan them.
        job_ids = self._client(["squeue", "-h", "-o", "%A"]).split()
        if job_ids:
            self._client(["scancel", *job_ids])
        deadline = time.monotonic() + timeout
        while self._client(["squeue", "-h", "-t", "R,CG,CF,S,SO,ST", "-o", "%A"]).strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.25)

    # ---- state -----------------------------------------------------------------------------------------

    def _daemon_alive(self, name: str) -> bool:
        return procs.alive(procs.read_pid(self.root / "run" / f"{name}.pid"), name.split("-")[0])

    def _controller_up(self) -> bool:
        return "is UP" in self._client(["scontrol", "ping"])

    def healthy(self) -> bool:
        """slurmctld, every slurmd and munge run with this configuration, and every node can take work."""
        if not self.conf_path.exists() or self.conf_path.read_text() != self.render_conf():
            return False
        if not all(self._daemon_alive(name) for name in ("slurmctld", *(f"slurmd-{n}" for n in NODES))):
            return False
        if not munge.works():
            return False
        states = self.node_states()
        return set(states) == set(NODES) and set(states.values()) <= _USABLE_NODE_STATES

    def node_states(self) -> dict[str, str]:
        """{node: sinfo short state} for the partition; empty if the controller does not answer."""
        out = self._client(["sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %t"])
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def status(self) -> str:
        if not self.conf_path.exists() or not self._daemon_alive("slurmctld"):
            return f"local Slurm cluster under {self.root} is not running"
        return self._client(["sinfo"]) + self._client(["sinfo", "-N", "-l"])

    def logs(self, lines: int = 30) -> str:
        files = sorted((self.root / "log").glob("*")) + sorted((self.root / "munge").glob("*.log"))
        return "\n".join(procs.tail(path, lines) for path in files)

    def _client(self, argv: list[str], timeout: float = 15.0) -> str:
        """stdout of a Slurm client command, or "" if it failed (callers poll, so failure is a state)."""
        try:
            result = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout)
        except (subprocess.TimeoutExpired, FileNotFoundError):
            return ""
        return result.stdout if result.returncode == 0 else ""

    # ---- jobs ------------------------------------------------------------------------------------------

    def job_info(self, job_id: int | str) -> list[dict[str, str]]:
        """`scontrol show job` as one dict per record (an array job has one per task); [] if unknown.

        Works without accounting: finished jobs stay visible for MinJobAge seconds.
        """
        out = self._client(["scontrol", "show", "job", "-o", str(job_id)])
        return [_parse_record(line) for line in out.splitlines() if line.strip()]

    def wait_job(self, job_id: int | str, timeout: float = 60.0, poll: float = 0.5) -> str:
        """Wait until every record of the job is in a terminal state; return it.

        For an array job: "COMPLETED" if every task completed, else the first other final state.
        """
        deadline = time.monotonic() + timeout
        while True:
            records = self.job_info(job_id)
            if not records:
                raise ClusterError(f"job {job_id} is unknown to slurmctld (never submitted, or purged)")
            states = [record.get("JobState", "") for record in records]
            if all(state in TERMINAL_STATES for state in states):
                return next((state for state in states if state != "COMPLETED"), "COMPLETED")
            if time.monotonic() > deadline:
                reasons = sorted({f"{r.get('JobState')} ({r.get('Reason')})" for r in records})
                raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f}s: {', '.join(reasons)}")
            time.sleep(poll)


# A key is a word (Slurm's keys include ':' and '/', e.g. "TRES", "MinCPUsNode", "Socks/Node") preceded by
# the start of the line or a space. Values may contain spaces (Command=, Comment=), so split on keys.
_KEY = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


def _parse_record(line: str) -> dict[str, str]:
    keys = list(_KEY.finditer(line))
    return {
        match.group(1): line[match.end() : (keys[i + 1].start() if i + 1 < len(keys) else len(line))].strip()
        for i, match in enumerate(keys)
    }
