"""The hang watchdog (runtime/fault_tolerance/watchdog.py) against STAND-IN workers: small Python processes that
report their sections through the real progress records (runtime/fault_tolerance/progress.py) and sleep where a
trainer would compute, so that what is under test is the timing rule, not training (the real trainer meets the
watchdog on Slurm, tests/checkpoint/test_fault_tolerance_slurm.py). Both sides of each timeout:
  - a first step slower than the step timeout but within the setup timeout (a Neuron compile) is no hang; a first
    step past the setup timeout is one, named as such;
  - a checkpoint save slower than the step timeout but within the checkpoint timeout is no hang; one past it is;
  - a step that has run before is timed by the learned timeout (factor x its slowest, at least the floor);
and of naming: of two stalled ranks, the one inside a collective is not the one named."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from runtime.fault_tolerance import progress
from runtime.fault_tolerance.watchdog import Timeouts, Watchdog, culprit

# setup 4 s, checkpoint 3 s, step learned with factor 5 over a 1 s floor: the margins below are 2x either way.
TIMEOUTS = Timeouts(setup_s=4.0, checkpoint_s=3.0, step_s=None, factor=5.0, floor_s=1.0)

# A stand-in worker: steps 1..N, each `data` then `step` (0.02 s), a checkpoint section after step 3; `slow` makes one
# section of one step sleep that long, and a sleep longer than the test is a hang.
WORKER = textwrap.dedent("""
    import sys, time
    from runtime.fault_tolerance.progress import Progress
    steps, slow_section, slow_step, slow_s = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    p = Progress(0, 0, sys.argv[5], None, None)
    time.sleep(0.2)  # setup
    for step in range(1, steps + 1):
        for section in ("data", "step") + (("checkpoint",) if step == 3 else ()):
            p.enter(section, step)
            time.sleep(slow_s if (section, step) == (slow_section, slow_step) else 0.02)
    p.close()
""")


def _run(tmp_path, slow_section: str, slow_step: int, slow_s: float, steps: int = 6):
    """(the worker's exit code, the watchdog's verdict or None, seconds)."""
    directory = tmp_path / "progress"
    directory.mkdir(parents=True)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(steps), slow_section, str(slow_step), str(slow_s),
                               str(directory)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    watchdog = Watchdog(str(directory), nproc=1, nnodes=1, timeouts=TIMEOUTS, poll_s=0.2).start()
    started = time.monotonic()
    try:
        code = worker.wait(timeout=30)
    finally:
        worker.kill()
        watchdog.stop()
    return code, watchdog.fired, time.monotonic() - started


def test_a_slow_first_step_is_no_hang_and_a_hung_one_is_named_by_the_setup_timeout(tmp_path):
    code, fired, _ = _run(tmp_path / "slow", "step", 1, 2.0)  # over the 1 s step floor, within setup's 4 s
    assert code == 0 and fired is None
    code, fired, seconds = _run(tmp_path / "hung", "step", 1, 60.0)
    assert code == -9 and fired is not None and seconds < 15
    assert (fired["section"], fired["step"], fired["timeout_s"]) == ("step", 1, 4.0), fired
    assert fired["timeout_from"].startswith("setup_timeout_s: the first step"), fired


def test_a_slow_checkpoint_is_no_hang_and_a_hung_one_is_named_by_the_checkpoint_timeout(tmp_path):
    code, fired, _ = _run(tmp_path / "slow", "checkpoint", 3, 1.5)  # over the step floor, within 3 s
    assert code == 0 and fired is None
    code, fired, _ = _run(tmp_path / "hung", "checkpoint", 3, 60.0)
    assert code == -9 and fired is not None
    assert (fired["section"], fired["step"], fired["timeout_s"], fired["timeout_from"]) == \
        ("checkpoint", 3, 3.0, "checkpoint_timeout_s"), fired


def test_a_later_step_is_timed_by_the_learned_timeout(tmp_path):
    code, fired, seconds = _run(tmp_path / "hung", "step", 5, 60.0)
    assert code == -9 and fired is not None and seconds < 10
    assert (fired["section"], fired["step"], fired["timeout_s"]) == ("step", 5, 1.0), fired
    assert fired["timeout_from"].startswith("step_timeout_floor_s"), fired


def test_timeouts_by_section():
    learned = {"section": "step", "slowest": {"step": 0.5}}
    assert TIMEOUTS.of(learned) == (2.5, "5 x its slowest recent step 0.50 s")
    assert TIMEOUTS.of({"section": "step", "slowest": {}})[0] == 4.0  # its first run: it may compile
    assert TIMEOUTS.of({"section": "validation", "slowest": {"step": 9.0}})[0] == 4.0
    assert TIMEOUTS.of({"section": "setup"})[0] == 4.0 and TIMEOUTS.of({"section": "checkpoint"})[0] == 3.0
    assert TIMEOUTS.of({"section": "done"})[0] is None
    fixed = Timeouts(4.0, 3.0, 7.0, 5.0, 1.0)
    assert fixed.of(learned) == (7.0, "step_timeout_s") and fixed.of({"section": "data", "slowest": {"data": 1}})[0] == 7
    assert Timeouts.from_env(TIMEOUTS.env()) == TIMEOUTS and Timeouts.from_env({}) is None


def test_the_rank_named_is_not_the_one_waiting_in_a_collective():
    waiting = {"rank": 0, "section": "step", "step": 10, "since": 1.0, "over": True, "waiting": True}
    stuck = {"rank": 1, "section": "step", "step": 10, "since": 2.0, "over": True, "waiting": False}
    assert culprit([waiting, stuck])["rank"] == 1
    # Nobody outside a collective: the one furthest behind.
    assert culprit([waiting, {**stuck, "waiting": True, "step": 9}])["rank"] == 1
    assert culprit([waiting, {**stuck, "waiting": True}])["rank"] == 0


def test_a_stalled_worker_tells_its_stack(tmp_path):
    """SIGUSR2 makes a worker write its Python stack (faulthandler), which the watchdog reads to tell a rank waiting
    in a collective from the one it waits for."""
    directory = tmp_path / "progress"
    directory.mkdir()
    code = textwrap.dedent(f"""
        import time
        from runtime.fault_tolerance.progress import Progress
        p = Progress(0, 0, {str(directory)!r}, None, None)
        p.enter("step", 1)
        def stuck_here():
            time.sleep(60)
        stuck_here()
    """)
    worker = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 10
        while progress.read_record(progress.record_path(str(directory), 0)) is None or \
                progress.read_record(progress.record_path(str(directory), 0))["section"] != "step":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        watchdog = Watchdog(str(directory), nproc=1, nnodes=1, timeouts=TIMEOUTS)
        verdicts = watchdog._stacks(watchdog.records())
    finally:
        worker.kill()
    waiting, where = verdicts[0]
    assert not waiting and "stuck_here" in where, where



def test_a_rank_waiting_for_a_slow_save_is_no_hang_until_the_save_passes_its_own_timeout(tmp_path, monkeypatch):
    """Rank 0 waits in a collective past its step timeout for rank 1, which is still saving within the checkpoint
    timeout: not a hang. Once rank 1 passes the checkpoint timeout, rank 1 is the one named. (Records and stack
    verdicts are given here; how they are read is the tests above.)"""
    watchdog = Watchdog(str(tmp_path), nproc=2, nnodes=1, timeouts=TIMEOUTS)
    monkeypatch.setattr(watchdog, "_stacks", lambda records: {0: (True, "collectives.py:120 in all_reduce"),
                                                              1: (False, "storage.py:40 in write")})
    killed = []
    monkeypatch.setattr(watchdog, "_kill_workers", lambda records: killed.append(records))
    records = {0: {"rank": 0, "pid": None, "section": "step", "step": 5, "since": 100.0, "slowest": {"step": 0.1}},
               1: {"rank": 1, "pid": None, "section": "checkpoint", "step": 4, "since": 99.5, "slowest": {}}}
    assert watchdog.stalled(records, 102.0)  # rank 0: 2 s over its 1 s floor
    assert watchdog._detect(records, 102.0) is False and watchdog.fired is None and not killed
    assert watchdog._detect(records, 103.0) is True and killed  # rank 1: 3.5 s, over its 3 s checkpoint timeout
    assert (watchdog.fired["rank"], watchdog.fired["section"], watchdog.fired["waiting_ranks"]) == (1, "checkpoint", 1)
    # Every rank in a collective: a deadlock, named at once (the one furthest behind).
    stuck = Watchdog(str(tmp_path), nproc=2, nnodes=1, timeouts=TIMEOUTS)
    monkeypatch.setattr(stuck, "_stacks", lambda records: {0: (True, "a"), 1: (True, "b")})
    monkeypatch.setattr(stuck, "_kill_workers", lambda records: None)
    assert stuck._detect(records, 102.0) is True and stuck.fired["rank"] == 1



def test_a_rank_ahead_of_another_waits_for_it_whatever_its_stack_says(tmp_path, monkeypatch):
    """On NCCL or XLA a rank waiting for the others blocks in the device (a read, the step boundary), not in the
    collective: one a step ahead of another live rank is waiting, so a slow save is no hang there either."""
    watchdog = Watchdog(str(tmp_path), nproc=2, nnodes=1, timeouts=TIMEOUTS)
    monkeypatch.setattr(watchdog, "_stacks", lambda records: {0: (False, "cuda_kernels.py:1 in read"),
                                                              1: (False, "storage.py:40 in write")})
    monkeypatch.setattr(watchdog, "_kill_workers", lambda records: None)
    records = {0: {"rank": 0, "pid": None, "section": "step", "step": 5, "since": 100.0, "slowest": {"step": 0.1}},
               1: {"rank": 1, "pid": None, "section": "checkpoint", "step": 4, "since": 99.5, "slowest": {}}}
    assert watchdog._detect(records, 102.0) is False
    assert watchdog._detect(records, 103.0) is True and watchdog.fired["rank"] == 1


def test_a_torn_record_keeps_the_last_good_one(tmp_path):
    watchdog = Watchdog(str(tmp_path), nproc=1, nnodes=1, timeouts=TIMEOUTS)
    path = progress.record_path(str(tmp_path), 0)
    with open(path, "w") as f:
        f.write('{"rank": 0, "pid": 1, "section": "step", "step": 3, "since": 5.0, "slowest": {}}')
    assert watchdog.records()[0]["section"] == "step"
    with open(path, "w") as f:
        f.write('{"rank": 0, "pid": 1, "sect')  # the worker writing just then
    assert watchdog.records()[0]["step"] == 3 and watchdog.records()[0]["section"] == "step"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
