"""Shared by the fixtures that start real servers on loopback (sshd, moto_server), and the tests that hand a
process a port to listen on."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, log: Path, name: str, timeout: float) -> None:
    """Return once 127.0.0.1:port accepts connections; fail with the server's log if it dies or never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{name} did not start: {log.read_text()[-2000:]}", pytrace=False)
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server, and kill it if it has not gone within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
