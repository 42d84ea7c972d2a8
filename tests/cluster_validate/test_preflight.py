"""runtime/preflight.py: two gloo ranks pass in a second or two; a rank that never arrives is named by the
roll call; a collective that hangs ends the process within the timeout with one clear line (it would
otherwise wait for gloo's own timeout, 30 minutes by default)."""

import re
import subprocess
import sys
import time

import pytest

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


def run_pair(tmp_path, mode: str, timeout_s: float):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), mode, str(tmp_path / "store"), str(timeout_s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        out0, err0 = procs[0].communicate(timeout=60)
        ended = time.time()
        # Timed from rank 0's call of preflight(), not from the process start: two interpreters importing torch on
        # a machine shared with other tests take a varying part of 20 s, and what is under test is the timeout.
        found = re.search(r"preflight starts at ([0-9.]+)", out0)
        assert found, f"rank 0 never called preflight(): {err0[-2000:]}"
        return procs[0].returncode, out0, err0, ended - float(found.group(1))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


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
