"""A full disk, for real and without root: the child process gets RLIMIT_FSIZE (SIGXFSZ ignored), so that a write
past `max_bytes` fails with EFBIG, as a write to a full disk fails with ENOSPC and one over a quota with EDQUOT. The
code under test handles the three alike (runtime/io/files.py NO_ROOM). No unprivileged tmpfs or loop device here."""
from __future__ import annotations

import resource
import signal
from typing import Callable


def file_size_limit(max_bytes: int) -> Callable[[], None]:
    """A preexec_fn for subprocess: the child's files cannot grow past `max_bytes`."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit
