"""Finding, checking and stopping the daemons the local cluster starts, by pid file only.

The daemons fork into the background, and in a container the process that adopts them may never reap them,
so a stopped daemon can linger as a zombie: `alive` reads /proc instead of trusting kill(pid, 0), and checks
the command name so that a pid reused by something else is never signalled.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

# Daemons live in sbin, which a non-login root shell (or CI runner) may not have on PATH.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])


def binary(name: str) -> str:
    found = shutil.which(name, path=_SEARCH_PATH)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found on PATH or in /usr/sbin; install Slurm and munge with "
            "csp_tools/local_slurm/install.sh"
        )
    return found


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def alive(pid: int | None, name: str) -> bool:
    """True if `pid` is a running (not zombie) process whose command name is `name`."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    # /proc/<pid>/stat is "pid (comm) state ..."; comm may itself contain spaces or parentheses.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state = stat[stat.rindex(")") + 2 :].split()[0]
    return comm == name[:15] and state not in ("Z", "X")


def stop(pid_file: Path, name: str, timeout: float = 10.0) -> None:
    """SIGTERM the process in `pid_file` if it is `name`, wait, then SIGKILL; remove the pid file."""
    pid = read_pid(pid_file)
    if alive(pid, name):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(pid, name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid, name):
            os.kill(pid, signal.SIGKILL)
            while alive(pid, name) and time.monotonic() < deadline + 5:
                time.sleep(0.1)
    pid_file.unlink(missing_ok=True)


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, headed by its name, for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        text = ["(no such file)"]
    return "\n".join([f"--- {path} ---", *text])


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return pids


def job_processes_of(slurm_conf: Path) -> list[int]:
    """Live slurmstepd and job tasks of the cluster configured by `slurm_conf`, never this process or its parents.

    Both inherit SLURM_CONF (stepd from slurmd, tasks from the submitting client); tasks also carry SLURM_JOB_ID.
    They outlive a slurmd that was killed with jobs still running, so `down` looks for them this way.
    """
    marker = f"SLURM_CONF={slurm_conf}".encode()
    mine = _ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker not in environ:
            continue
        is_task = any(var.startswith(b"SLURM_JOB_ID=") for var in environ)
        if is_task or alive(int(entry.name), "slurmstepd"):
            found.append(int(entry.name))
    return found
