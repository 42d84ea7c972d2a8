# The watchdog: a thread of each node's runtime.torchrun, outside the training processes, that reads its workers'
# progress records (progress.py) and ends the job step when a section makes no progress for its timeout.
#
# Timeouts (the stage's fault_tolerance keys, which the job script exports as NXDT_FT_*):
#   setup       from the worker's start to its first section, and any section's first run in this process (it may
#               be compiling its graph: a Neuron first step takes minutes and is no hang);
#   checkpoint  a save;
#   step        a step, a data wait or a validation once it has run before: step_timeout_s where set, else learned,
#               step_timeout_factor x the slowest of its recent runs, and never under step_timeout_floor_s.
#
# Who hung: the ranks that wait for a hung one stop making progress too, inside a collective. So before naming
# one, the watchdog asks every stalled worker for its Python stack (SIGUSR2, progress.py), and on a multi-node job
# it shares what it saw through the attempt's directory on the shared file system: the first watchdog to see a
# stall writes stall_<node>.json, every other watchdog answers with its own, and the rank named is one that is not
# inside a collective and is furthest behind (lowest step, earliest section, longest silent). Its node's line, once
# per attempt, names rank, host and section; hang.json keeps it for the job script (attempts.py), and every node
# then kills its workers, so that torchrun exits and srun ends the step.
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass

from runtime.fault_tolerance import progress
from runtime.fault_tolerance.progress import node_name  # noqa: F401 - torchrun and the checks import it here
from runtime.io.files import atomic_write_bytes, atomic_write_json, publish_first, read_json, temp_name

HANG_EXIT_CODE = 124  # as timeout(1): the job script tells a hang from a worker's own exit by hang.json, not by it
SECTION_ORDER = ("setup", "data", "step", "validation", "checkpoint", "shutdown")
# Frames that mean "blocked until the other ranks get here": a collective (gloo blocks in it), or the device's step
# boundary, synchronize and barrier (NCCL and XLA return from the collective at once and block there).
_WAITING_MARKS = ("torch/distributed/", "runtime/parallel/collectives.py", "torch_xla/", "runtime/device.py")
ATTEMPT_ENV = "NXDT_ATTEMPT_DIR"


@dataclass(frozen=True)
class Timeouts:
    setup_s: float
    checkpoint_s: float
    step_s: float | None    # None: learned
    factor: float
    floor_s: float

    ENV = ("NXDT_FT_SETUP_TIMEOUT_S", "NXDT_FT_CHECKPOINT_TIMEOUT_S", "NXDT_FT_STEP_TIMEOUT_S",
           "NXDT_FT_STEP_TIMEOUT_FACTOR", "NXDT_FT_STEP_TIMEOUT_FLOOR_S")

    @classmethod
    def from_env(cls, env=os.environ) -> "Timeouts | None":
        """None where the job script set no timeouts: no watchdog."""
        if not env.get(cls.ENV[0]):
            return None
        setup, checkpoint, step, factor, floor = (env.get(name, "") for name in cls.ENV)
        return cls(float(setup), float(checkpoint), float(step) if step else None, float(factor or 5),
                   float(floor or 0))

    def env(self) -> dict[str, str]:
        values = (self.setup_s, self.checkpoint_s, "" if self.step_s is None else self.step_s, self.factor,
                  self.floor_s)
        return {name: f"{value:g}" if not isinstance(value, str) else value for name, value in zip(self.ENV, values)}

    def of(self, record: dict) -> tuple[float | None, str]:
        """The timeout of the section a record is in, and where it comes from; None: not timed."""
        section, slowest = record.get("section"), record.get("slowest") or {}
        if section == "done":
            return None, "finished"
        if section == "setup":
            return self.setup_s, "setup_timeout_s"
        if section in ("checkpoint", "shutdown", "peer_lost"):  # a save, or leaving (the last save's wait, teardown)
            return self.checkpoint_s, "checkpoint_timeout_s"
        if section not in slowest:
            return self.setup_s, f"setup_timeout_s: the first {section} in this process may compile"
        if self.step_s is not None and section in ("step", "data"):
            return self.step_s, "step_timeout_s"
        learned = self.factor * slowest[section]
        if learned <= self.floor_s:
            return self.floor_s, f"step_timeout_floor_s, above {self.factor:g} x its slowest recent {slowest[section]:.2f} s"
        return learned, f"{self.factor:g} x its slowest recent {section} {slowest[section]:.2f} s"


def _main_thread_frames(dump: str) -> list[str]:
    """The main thread's frames, innermost first, from one faulthandler dump (threads are listed newest first, so
    the main thread is the last block)."""
    blocks = [b for b in dump.split("\n\n") if "(most recent call first)" in b]
    if not blocks:
        return []
    lines = blocks[-1].splitlines()
    return [line.strip() for line in lines[1:] if line.strip().startswith("File ")]


def _where(frames: list[str]) -> tuple[bool, str]:
    """(waiting in a collective, the innermost frame as file:line function)."""
    waiting = any(mark in frame for frame in frames for mark in _WAITING_MARKS)
    if not frames:
        return False, "no stack"
    # File "/x/y.py", line 12 in func
    text = frames[0].replace('File "', "").replace('", line ', ":")
    return waiting, text


def _order(r: dict) -> tuple[int, int]:
    return (r.get("step", 0), SECTION_ORDER.index(r["section"]) if r.get("section") in SECTION_ORDER else 0)


def mark_waiting(ranks: list[dict]) -> list[dict]:
    """A rank further on than another live one (a later step, or a later section of the same step) waits for it,
    whatever its stack shows: on NCCL or XLA a rank blocks wherever the device makes it wait."""
    live = [r for r in ranks if r.get("section") not in ("done", "peer_lost")]
    if not live:
        return ranks
    earliest = min(_order(r) for r in live)
    return [{**r, "waiting": True} if r in live and _order(r) > earliest else r for r in ranks]


def culprit(ranks: list[dict]) -> dict:
    """The rank to name among every stalled rank seen: not waiting in a collective where any such rank exists (past
    its own timeout first), then the furthest behind."""
    live = [r for r in ranks if r.get("section") not in ("done", "peer_lost")] or ranks

    def key(r):
        waiting = bool(r.get("waiting"))
        # Among ranks that wait in collectives (a deadlock), whether one is past its timeout says nothing.
        return (waiting, False if waiting else not r.get("over"), *_order(r), r.get("since", 0))

    return min(live, key=key)


class Watchdog:
    def __init__(self, directory: str, nproc: int, nnodes: int, timeouts: Timeouts, attempt_dir: str | None = None,
                 poll_s: float = 1.0, gather_s: float = 5.0):
        self.directory, self.nproc, self.nnodes, self.timeouts = directory, nproc, nnodes, timeouts
        self.attempt_dir, self.poll_s, self.gather_s = attempt_dir, poll_s, gather_s
        self.node = node_name()
        self.started = time.time()
        self.fired: dict | None = None  # the decision, once this node stopped its workers for a hang
        self._last: dict[int, dict] = {}  # each worker's last good record
        self._answered = 0.0  # the newest other node's stall this one answered
        self.recheck_s = max(poll_s, 2.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nxdt-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def records(self) -> dict[int, dict]:
        for local in range(self.nproc):
            record = progress.read_record(progress.record_path(self.directory, local))
            if record is not None:  # a torn read (the worker writing just then) keeps the last good one
                self._last[local] = {**record, "local_rank": local}
            # Before its first record a worker is starting (importing, joining the group): setup, since we began.
            self._last.setdefault(local, {"rank": None, "pid": None, "section": "setup", "step": 0,
                                          "since": self.started, "slowest": {}, "local_rank": local})
        return dict(self._last)

    def judged(self, record: dict, now: float) -> dict:
        """The record with its section's timeout, where that comes from, how long it has been silent, and whether
        that is over the timeout."""
        timeout, why = self.timeouts.of(record)
        silent = now - float(record.get("since", now))
        return {**record, "silent": silent, "timeout": timeout, "why": why,
                "over": timeout is not None and silent > timeout}

    def stalled(self, records: dict[int, dict], now: float) -> list[dict]:
        return [judged for record in records.values() if (judged := self.judged(record, now))["over"]]

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.time()
            records = self.records()
            if self.stalled(records, now):
                if self._detect(records, now):
                    return
                self._stop.wait(self.recheck_s)  # the rank they wait for is still within its own timeout
                continue
            if self.attempt_dir and (asked := self._asked()) is not None:
                self._snapshot(records, now, detected=False, answering=asked)

    def _asked(self) -> float | None:
        """The time of the newest stall another node's watchdog wrote that this one has not answered yet."""
        newest = None
        for path in _stall_files(self.attempt_dir):
            if os.path.basename(path) == f"stall_{self.node}.json":
                continue
            asked = (read_json(path) or {}).get("at")
            if asked is not None and asked > self._answered and (newest is None or asked > newest):
                newest = asked
        return newest

    def _snapshot(self, records: dict[int, dict], now: float, *, detected: bool, answering: float = 0.0
                  ) -> list[dict]:
        """Every local rank's record with its stack's verdict; written for the other nodes' watchdogs."""
        self._answered = max(self._answered, answering)
        ranks = []
        stacks = self._stacks(records)
        for local, record in records.items():
            waiting, where = stacks.get(local, (False, "no stack"))
            ranks.append({**self.judged(record, now), "node": self.node, "waiting": waiting, "where": where})
        if self.attempt_dir:
            atomic_write_json(os.path.join(self.attempt_dir, f"stall_{self.node}.json"),
                              {"node": self.node, "detected": detected, "at": max(now, answering), "ranks": ranks})
        return ranks

    def _stacks(self, records: dict[int, dict]) -> dict[int, tuple[bool, str]]:
        sizes = {}
        for local, record in records.items():
            path = progress.stack_path(self.directory, local)
            sizes[local] = os.path.getsize(path) if os.path.exists(path) else 0
            if record.get("pid") and record.get("section") not in ("done", "peer_lost"):
                try:
                    os.kill(int(record["pid"]), progress.STACK_SIGNAL)
                except OSError:
                    pass
        time.sleep(0.5)
        verdicts = {}
        for local in records:
            try:
                with open(progress.stack_path(self.directory, local)) as f:
                    f.seek(sizes[local])
                    verdicts[local] = _where(_main_thread_frames(f.read()))
            except OSError:
                continue
        return verdicts

    def _detect(self, records: dict[int, dict], now: float) -> bool:
        """Whether a rank hung: one that is not waiting for another is past its own timeout, or every rank waits
        in a collective (a deadlock). A rank past its step timeout while it waits for one still within a longer
        timeout (a save slower than a step, say) is no hang yet: False, and the caller looks again."""
        ranks = self._snapshot(records, now, detected=True)
        complete = True
        if self.attempt_dir and self.nnodes > 1:
            deadline = time.time() + self.gather_s
            while time.time() < deadline and len(self._answers(now)) < self.nnodes:
                time.sleep(0.2)
            answers = self._answers(now)
            complete = len(answers) >= self.nnodes
            ranks = [r for answer in answers for r in answer.get("ranks", [])]
        ranks = mark_waiting(ranks)
        named = culprit(ranks)
        live = [r for r in ranks if r.get("section") not in ("done", "peer_lost")]
        if not named.get("over") and (not complete or not all(r.get("waiting") for r in live)):
            # The rank the others wait for is within its own timeout, or a node has not answered yet (its ranks
            # may be the busy ones): look again.
            return False
        behind = sum(1 for r in ranks if r is not named and r.get("waiting"))
        decision = {"cause": "hang", "rank": named.get("rank"), "node": named.get("node", self.node),
                    "section": named.get("section"), "step": named.get("step"), "last_progress_at": named.get("since"),
                    "detected_at": time.time(), "silent_s": named.get("silent"), "timeout_s": named.get("timeout"),
                    "timeout_from": named.get("why"), "where": named.get("where"), "waiting_ranks": behind}
        self.fired = decision
        first = True
        if self.attempt_dir:
            first = _create_json(os.path.join(self.attempt_dir, "hang.json"), decision)  # one node prints it
        if first:
            print(f"nxdt: hang: rank {decision['rank']} on {decision['node']} made no progress in section "
                  f"{decision['section']} (step {decision['step']}) for {decision['silent_s']:.0f} s, over its "
                  f"{decision['timeout_s']:.0f} s timeout ({decision['timeout_from']}); stuck at {decision['where']}"
                  f"{f'; {behind} other rank(s) wait for it in a collective' if behind else ''}; stopping the workers",
                  flush=True)
        self._kill_workers(records)
        return True

    def _answers(self, asked: float) -> list[dict]:
        """Every node's snapshot written since `asked` (this node's own included)."""
        found = [read_json(path) or {} for path in _stall_files(self.attempt_dir)]
        return [a for a in found if (a.get("at") or 0) >= asked - 1e-6]

    def _kill_workers(self, records: dict[int, dict]) -> None:
        pids = {int(r["pid"]) for r in records.values() if r.get("pid")}
        try:  # workers that never wrote a record too: every child of this torchrun
            import psutil

            pids |= {child.pid for child in psutil.Process().children(recursive=True)}
        except Exception:  # psutil missing or a child gone: the recorded pids are the workers
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _stall_files(directory: str) -> list[str]:
    try:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                      if n.startswith("stall_") and n.endswith(".json"))
    except OSError:
        return []


def _create_json(path: str, data: dict) -> bool:
    """Publish `data` at `path` unless a file is there already; False when another process's came first."""
    tmp = temp_name(path)
    atomic_write_bytes(tmp, json.dumps(data).encode())
    return publish_first(tmp, path)
