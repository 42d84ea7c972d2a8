"""torchrun, ending in one line instead of a traceback, with the failing worker's exit code.

    python -m runtime.torchrun --standalone --nproc_per_node 2 -m runtime.train --config training_config.yaml

Takes exactly torchrun's arguments and starts the workers the same way. What differs is the end of a failed run:
torchrun re-raises a worker's failure as its own ChildFailedError (a traceback and a 20-line box around "exitcode:
2") and exits 1 whatever the worker said. The worker has already printed its reason on one `error:` line, so this
prints one line naming the worker and exits with that worker's code: a user mistake stays 2, a checkpointed stop
for requeue stays 75 (PREEMPTED_EXIT_CODE, runtime/schema/facts.py), so the job script can tell them apart. A
worker killed by a signal exits 128 + the signal, as a shell reports it; so does torchrun itself when it is
signalled.
"""
from __future__ import annotations

import signal
import sys


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


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as failed:
        rank, failure = root_cause(failed.failures)
        code = exit_code(failure.exitcode)
        how = (f"was killed by {_signal_name(-failure.exitcode)}" if failure.exitcode < 0
               else f"exited with {failure.exitcode}")
        print(f"nxdt: worker rank {rank} {how}; its output above says why; exiting {code}",
              file=sys.stderr, flush=True)
        return code
    except SignalException as stopped:
        print(f"nxdt: torchrun received {_signal_name(int(stopped.sigval))}; the workers were stopped",
              file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
