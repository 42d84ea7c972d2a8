"""runtime/workers.py: results in order, a worker's exception re-raised, and a worker killed at any point (above
all while it writes a result) named at once, never waited on forever."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from runtime.workers import OrderedPool, RemoteTraceback, WorkerDied

_flag: list[str] = []


def _setup(flag_dir: str) -> None:
    _flag.append(flag_dir)


def _square_slowly(n: int) -> tuple[int, int]:
    time.sleep(0.002 * (n % 5))  # uneven task times: results still come back in submission order
    return n, n * n


def _fail(n: int) -> None:
    raise KeyError(f"no {n}")


def _big_result(megabytes: int) -> bytes:
    """A result far larger than a pipe holds: writing it blocks until the parent reads. The flag file says the
    write is about to start."""
    Path(_flag[0], str(os.getpid())).touch()
    return b"x" * (megabytes << 20)


def _pid(_: int) -> int:
    return os.getpid()


def _wait_for_flag(directory: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flags = list(directory.iterdir())
        if flags:
            return int(flags[0].name)
        time.sleep(0.05)
    raise AssertionError("the task never started")


def test_results_come_back_in_submission_order(tmp_path):
    with OrderedPool(3, _setup, (str(tmp_path),)) as pool:
        got = list(pool.map(_square_slowly, [(n,) for n in range(50)], ahead=2))
        assert len({pid for pid in pool.map(_pid, [(n,) for n in range(9)])}) == 3  # every worker took tasks
    assert got == [(n, n * n) for n in range(50)]


def test_an_exception_in_a_worker_is_raised_in_the_caller_with_its_traceback(tmp_path):
    with pytest.raises(KeyError, match="no 7") as caught:
        with OrderedPool(2, _setup, (str(tmp_path),)) as pool:
            list(pool.map(_fail, [(7,)]))
    assert isinstance(caught.value.__cause__, RemoteTraceback)
    assert "in _fail" in str(caught.value.__cause__)


def test_a_worker_killed_while_writing_its_result_is_named_not_waited_on(tmp_path):
    # The case ProcessPoolExecutor hangs on: half a message in the result pipe. Here the worker writes 64 MiB into
    # a pipe that holds 64 KiB while the parent reads nothing, is killed in the middle, and the parent's read
    # ends at the cut.
    with OrderedPool(2, _setup, (str(tmp_path),)) as pool:
        pool.submit(_big_result, 64)
        pid = _wait_for_flag(tmp_path)
        time.sleep(0.5)  # the pipe fills in microseconds; the worker then blocks in the write
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDied, match=rf"worker process {pid} ended .*\(killed by SIGKILL\)"):
            pool.next_result()
        assert time.monotonic() - started < 10


def test_a_worker_killed_between_tasks_is_named_at_its_next_result(tmp_path):
    with OrderedPool(2, _setup, (str(tmp_path),)) as pool:
        pids = list(pool.map(_pid, [(0,), (1,)]))
        os.kill(pids[0], signal.SIGKILL)
        pool.submit(_pid, 2)
        with pytest.raises(WorkerDied, match="killed by SIGKILL"):
            pool.next_result()


def test_closing_with_results_still_owed_does_not_wait_for_them(tmp_path):
    pool = OrderedPool(2, _setup, (str(tmp_path),))
    pool.submit(_big_result, 64)  # blocks writing its result, which nobody will read
    _wait_for_flag(tmp_path)
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 10
    assert all(w.process.exitcode is not None for w in pool._workers)
