# What a restarted run records about the fault it recovers from: the job script's last "failed" record in the
# attempt history (attempts.py, NXDT_ATTEMPTS_FILE) that no "recovered" record follows. Rank 0 writes one
# "recovered" record, to metrics.jsonl and to the history, once the run is past the step the fault stopped:
#   time_to_detect_s   from the fault (a hang's last progress, a worker's death) to the job noticing it;
#   time_to_recover_s  from noticing it to the restarted run's first finished step;
#   time_lost_s        from the fault to the restarted run finishing the step it stopped in again: detection,
#                      restart, resume and the steps trained twice.
from __future__ import annotations

import json
import os
import time

from runtime.io.files import json_lines
from runtime.plot import read_metrics  # metrics.jsonl's one reader

HISTORY_ENV = "NXDT_ATTEMPTS_FILE"


def read_history(path: str) -> list[dict]:
    """The history's records; a line cut short by a node that died while writing is left out, the others count."""
    try:
        with open(path) as f:
            return json_lines(f.read())
    except OSError:
        return []


def append(path: str, record: dict) -> None:
    """One line, in one write: the history is shared by the batch script and rank 0 of every attempt."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def last_logged_step(results_dir: str) -> int:
    """The last step metrics.jsonl has a loss for (0: none): how far the run got before the fault."""
    try:
        rows = read_metrics(results_dir)
    except OSError:
        return 0
    return max((row["step"] for row in rows if "loss" in row), default=0)


class Recovery:
    def __init__(self, path: str, failure: dict, start_step: int, resumed: dict | None = None,
                 last_logged: int = 0):
        self.path, self.failure, self.start_step = path, failure, start_step
        self.resumed = resumed or {}
        # The last step finished before the fault (logged), and the furthest any rank had begun: the fault's step.
        self.last_logged = last_logged
        self.furthest = max(failure.get("step") or 0, last_logged)
        self.first_step_at: float | None = None

    @classmethod
    def from_env(cls, start_step: int, resumed: dict | None = None, results_dir: str | None = None
                 ) -> "Recovery | None":
        path = os.environ.get(HISTORY_ENV)
        if not path:
            return None
        pending, job_id = None, os.environ.get("SLURM_JOB_ID")
        for record in read_history(path):
            if record.get("job_id") != job_id:
                continue  # another job's (an earlier launch of this run): not what this one recovers from
            if record.get("event") == "failed" and record.get("action") != "stop":
                pending = record
            elif record.get("event") == "recovered":
                pending = None
        if not pending:
            return None
        return cls(path, pending, start_step, resumed, last_logged_step(results_dir) if results_dir else 0)

    def after_step(self, done: int) -> dict | None:
        """The "recovered" record, once, at the first step past both the resume and the fault's step."""
        if self.failure is None:  # recorded already
            return None
        now = time.time()
        if self.first_step_at is None:
            self.first_step_at = now
        if done < self.furthest:
            return None
        f = self.failure
        event = {"event": "recovered", "step": done, "job": f.get("job"), "job_id": f.get("job_id"),
                 "slurm_restart": f.get("slurm_restart"), "attempt": f.get("attempt"), "cause": f.get("cause"),
                 "resumed_from_step": self.start_step, "at": now,
                 # peer: the other nodes' memory (no file read); disk: the checkpoint directory; none: from scratch
                 "state_from": self.resumed.get("source", "none"), "state_where": self.resumed.get("where"),
                 "state_load_s": self.resumed.get("seconds"), "disk_reads": self.resumed.get("disk_reads"),
                 # steps finished (logged) before the fault and trained again
                 "fault_step": self.furthest, "steps_redone": max(0, self.last_logged - self.start_step),
                 "time_to_detect_s": f.get("time_to_detect_s"),
                 "time_to_recover_s": round(self.first_step_at - f["detected_at"], 3),
                 "time_lost_s": None if f.get("fault_at") is None else round(now - f["fault_at"], 3)}
        append(self.path, event)
        self.failure = None
        return event
