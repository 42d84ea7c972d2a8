"""torchrun, ending in one line instead of a traceback, with the failing worker's exit code.

    python -m runtime.torchrun --standalone --nproc_per_node 2 -m runtime.train --config training_config.yaml

Takes exactly torchrun's arguments and starts the workers the same way. What differs is the end of a failed run:
torchrun re-raises a worker's failure as its own ChildFailedError (a traceback and a 20-line box around "exitcode:
2") and exits 1 whatever the worker said. The worker has already printed its reason on one `error:` line, so this
prints one line naming the worker and exits with that worker's code: a user mistake stays 2, a checkpointed stop
for requeue stays 75 (PREEMPTED_EXIT_CODE, runtime/schema/facts.py), so the job script can tell them apart. A
worker killed by a signal exits 128 + the signal, as a shell reports it; so does torchrun itself when it is
signalled.

Where the job script set fault-tolerance timeouts (NXDT_FT_*), a watchdog thread here times the workers' sections
(runtime/fault_tolerance/watchdog.py) and stops them on a hang, exiting 124; with an attempt directory
(NXDT_ATTEMPT_DIR) this node also writes what it saw of the attempt there, for the job script to decide on.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time


def exit_code(worker_exit: int) -> int:
    """A worker's exit status as a shell reports it: negative (killed by signal N) becomes 128 + N."""
    if worker_exit < 0:
        return 128 + (-worker_exit)
    return worker_exit if 0 < worker_exit < 256 else 1


def root_cause(failures: dict) -> tuple[int, object]:
    """The worker whose failure stopped the others: torchrun lists the workers it then sent SIGTERM as failed too,
    at the same timestamp (whole seconds), so those count only when nothing else failed."""
    first = [rank for rank, f in failures.items() if f.exitcode != -signal.SIGTERM] or list(failures)
    rank = min(first, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def _start_watchdog(args):
    """The node's hang watchdog (runtime/fault_tolerance/watchdog.py), where the job script set its timeouts:
    the workers find their progress directory in the environment they inherit from here."""
    import tempfile

    from runtime.fault_tolerance import progress
    from runtime.fault_tolerance.watchdog import ATTEMPT_ENV, Timeouts, Watchdog

    timeouts = Timeouts.from_env()
    if timeouts is None:
        return None
    directory = tempfile.mkdtemp(prefix="nxdt-progress-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ[progress.DIR_ENV] = directory
    nnodes = int(str(args.nnodes).split(":")[-1])
    return Watchdog(directory, int(args.nproc_per_node), nnodes, timeouts,
                    attempt_dir=os.environ.get(ATTEMPT_ENV) or None).start()


def _report(watchdog, outcome: str, **fields) -> None:
    """What this node saw of the attempt, for the job script (runtime/fault_tolerance/attempts.py): its workers'
    last progress records and how the step ended here."""
    from runtime.fault_tolerance.watchdog import ATTEMPT_ENV, node_name
    from runtime.io.files import atomic_write_json

    attempt_dir = os.environ.get(ATTEMPT_ENV)
    if not attempt_dir or not os.path.isdir(attempt_dir):
        return
    records = list(watchdog.records().values()) if watchdog is not None else []
    try:  # what the job script decides on; never a reason to fail a run that finished
        atomic_write_json(os.path.join(attempt_dir, f"node_{node_name()}.json"),
                          {"node": node_name(), "outcome": outcome, "ended_at": time.time(), "records": records,
                           **fields})
    except OSError as error:
        print(f"nxdt: could not write this node's report of the attempt into {attempt_dir}: {error}",
              file=sys.stderr, flush=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from runtime.fault_tolerance.watchdog import HANG_EXIT_CODE

    args = parse_args(argv)
    watchdog = _start_watchdog(args)
    try:
        run(args)
    except ChildFailedError as failed:
        rank, failure = root_cause(failed.failures)
        if watchdog is not None and watchdog.fired:  # its one line already said who hung, and where
            _report(watchdog, "hang", hang=watchdog.fired)
            return HANG_EXIT_CODE
        code = exit_code(failure.exitcode)
        how = (f"was killed by {_signal_name(-failure.exitcode)}" if failure.exitcode < 0
               else f"exited with {failure.exitcode}")
        _report(watchdog, "exit", rank=rank, exit_code=code, failed_at=failure.timestamp)
        print(f"nxdt: worker rank {rank} {how}; its output above says why; exiting {code}",
              file=sys.stderr, flush=True)
        return code
    except SignalException as stopped:
        _report(watchdog, "signalled", signal=int(stopped.sigval))
        print(f"nxdt: torchrun received {_signal_name(int(stopped.sigval))}; the workers were stopped",
              file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    else:
        _report(watchdog, "ok")
    finally:
        if watchdog is not None:
            watchdog.stop()
            shutil.rmtree(watchdog.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
