"""runtime/preflight.py: two gloo ranks pass in a second or two; a rank that never arrives is named by the
roll call; a collective that hangs ends the process within the timeout with one clear line (it would
otherwise wait for gloo's own timeout, 30 minutes by default).

Each rank is a process of its own, forked from the test process (where torch is already imported) rather than a
fresh interpreter: what is under test is how a rank's preflight ends (its exit code, its one line, how soon), not
an interpreter's start, and two fresh interpreters importing torch cost ~4 s of CPU per test."""

import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import runtime.preflight  # noqa: F401 - imported here once, so that the forked ranks start with it

# Each rank: join a 2-rank gloo group through a file store, then behave as $MODE says.
RANK = """
import os, sys, time, datetime
import torch.distributed as dist
from runtime.preflight import preflight, PreflightError, PREFLIGHT_EXIT_CODE
rank, mode = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=600))
if rank == 1 and mode == "absent":
    time.sleep(60)
if rank == 1 and mode == "hang":
    # arrives at the roll call, then never joins the collectives
    from runtime import preflight as p
    p._roll_call(1, 2, 30)
    time.sleep(60)
print(f"preflight starts at {time.time()}", flush=True)
try:
    preflight(timeout_s=float(sys.argv[4]), nbytes=1 << 20)
except PreflightError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(PREFLIGHT_EXIT_CODE)
# As training's shutdown does: a gloo group torn down by interpreter exit alone can abort the process.
dist.destroy_process_group()
"""


def _fork_rank(argv: list[str], out: str, err: str) -> int:
    """RANK with sys.argv[1:] = argv in a forked child, its stdout and stderr into files; the child's pid. It exits
    as the script would: 0 at its end, sys.exit's code, or 1 with the traceback of anything it raised."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # One intra-op thread first: the parent's OpenMP threads do not survive the fork (tests/runtime_parallel/
        # dist_utils.py), and a torchrun worker has one.
        torch.set_num_threads(1)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        sys.argv = ["rank.py", *argv]
        exec(compile(RANK, "rank.py", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, in the rank's stderr
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout_s: float) -> int | None:
    """A forked rank's exit code as subprocess gives it (-n for signal n), or None while it runs past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def run_pair(tmp_path, mode: str, timeout_s: float):
    assert not dist.is_initialized(), "a forked rank would inherit this process's group"
    logs = [(str(tmp_path / f"rank{rank}.out"), str(tmp_path / f"rank{rank}.err")) for rank in (0, 1)]
    pids = [_fork_rank([str(rank), mode, str(tmp_path / "store"), str(timeout_s)], *logs[rank]) for rank in (0, 1)]
    running = set(pids)
    try:
        code = _wait(pids[0], 60)
        assert code is not None, "rank 0 did not end within 60 s"
        running.discard(pids[0])
        ended = time.time()
        out0, err0 = (Path(path).read_text() for path in logs[0])
        # Timed from rank 0's call of preflight(), not from the fork: what is under test is the timeout.
        found = re.search(r"preflight starts at ([0-9.]+)", out0)
        assert found, f"rank 0 never called preflight(): {err0[-2000:]}"
        return code, out0, err0, ended - float(found.group(1))
    finally:
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


def test_two_ranks_pass(tmp_path):
    code, out, err, _ = run_pair(tmp_path, "ok", 30)
    assert code == 0, err
    assert "preflight: 2 ranks on 1 host(s) ok; 1 MiB all_reduce busbw" in out


@pytest.mark.parametrize("mode, message", [
    ("absent", "rank(s) 1 of 2 did not reach the preflight within 3s"),
    ("hang", "an all_reduce of the rank numbers over 2 ranks did not complete within 3s on rank 0"),
])
def test_a_missing_or_stuck_peer_fails_fast_with_one_line(tmp_path, mode, message):
    code, _, err, took = run_pair(tmp_path, mode, 3)
    assert code == 3, err
    assert message in err and "nxdt-launch cluster-validate" in err
    assert "Traceback" not in err
    assert took < 20, f"took {took:.0f}s from the call of preflight()"
