"""Munge for the local Slurm cluster: a key, a running munged on the default socket, and nothing else.

Slurm's auth/munge plugin talks to /run/munge/munge.socket.2 unless told otherwise, so we use that socket and
every Slurm client works with no extra setting. If some munged already answers there (a system one, or one
that apt started) we use it and leave it alone; we stop only the munged we started, found by our pid file.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

from csp_tools.local_slurm import procs

SOCKET_DIR = Path("/run/munge")
KEY_FILE = Path("/etc/munge/munge.key")
USER = "munge"


def works() -> bool:
    """True when a credential round-trips through the daemon on the default socket."""
    try:
        encoded = subprocess.run(
            [procs.binary("munge"), "-n"], capture_output=True, timeout=10, check=True
        ).stdout
        subprocess.run(
            [procs.binary("unmunge")], input=encoded, capture_output=True, timeout=10, check=True
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError):
        return False
    return True


def _ensure_key(uid: int, gid: int) -> None:
    if KEY_FILE.exists():
        return
    # Same size mungekey --create writes (1024 bits); munged insists on the key being private to its user.
    KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
    os.chown(KEY_FILE.parent, uid, gid)
    os.chmod(KEY_FILE.parent, 0o700)
    fd = os.open(KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as key:
        key.write(os.urandom(128))
    os.chown(KEY_FILE, uid, gid)


def start(workdir: Path, timeout: float = 15.0) -> bool:
    """Make munge usable; returns True if we started a munged (and so must stop it), False if one was running."""
    if works():
        return False
    user = pwd.getpwnam(USER)
    _ensure_key(user.pw_uid, user.pw_gid)
    # /run is often a fresh tmpfs in containers; munged will not create its socket directory itself.
    SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    os.chown(SOCKET_DIR, user.pw_uid, user.pw_gid)
    os.chmod(SOCKET_DIR, 0o755)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chown(workdir, user.pw_uid, user.pw_gid)
    # munged refuses to run as root with a munge-owned key, so it runs as its own user; its pid, log and seed
    # go to our workdir so `down` can find it and a crash leaves a log to read.
    # Its early errors go to a file, not a pipe: a daemon that kept a pipe open would hang subprocess.run.
    with open(workdir / "munged.stderr", "wb") as stderr:
        subprocess.run(
            [
                procs.binary("munged"),
                f"--pid-file={workdir / 'munged.pid'}",
                f"--log-file={workdir / 'munged.log'}",
                f"--seed-file={workdir / 'munged.seed'}",
            ],
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            check=False,
        )
    deadline = time.monotonic() + timeout
    while not works():
        if time.monotonic() > deadline:
            logs = "\n".join(procs.tail(workdir / name) for name in ("munged.stderr", "munged.log"))
            raise RuntimeError(f"munged did not answer on {SOCKET_DIR} within {timeout:.0f}s\n{logs}")
        time.sleep(0.2)
    return True


def stop(workdir: Path) -> None:
    """Stop the munged we started, if any (a munged we found running is not ours and keeps running)."""
    procs.stop(workdir / "munged.pid", "munged")
