"""Worker processes whose death is an error, never a hang.

The tokenizing stages (data preparation, the SFT and preference caches) fan chunks out to spawned processes
and take the results back in order. concurrent.futures.ProcessPoolExecutor and multiprocessing.Pool share
one result pipe among all workers. A worker killed while it writes a result to that pipe (by the OOM killer,
say) leaves half a message in it. The executor's manager thread then waits forever for the rest, and the
other workers wait forever for the pipe's lock. The futures never fail, so the stage hangs until its time
limit. This was measured here: SIGKILL to one of two data_prep workers hung the run 1 time in 27. Pool
always hangs when a worker dies (bpo-22393).

Here each worker has its own two pipes, and the parent holds only its own ends. A worker that dies, at any
point, closes its ends, and the parent's next read from it ends in EOF: WorkerDied. The other way round, a
parent that dies (kill -9 of the task) closes its ends, and its workers leave at their next read or write. Tasks go round-robin
(task i to worker i % n). So the results of one worker's pipe come back in submission order, and reading
them in turn gives every result in order. A feeder thread per worker writes its tasks. The parent never
blocks writing a task while the worker blocks writing a result to a parent that is not reading.
"""
from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class WorkerDied(RuntimeError):
    """A worker process ended while it owed results; the message names its pid and how it ended."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker; set as the re-raised exception's __cause__."""

    def __str__(self) -> str:
        return self.args[0]


def _serve(tasks, results, initializer, initargs) -> None:
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            payload = tasks.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone or closed the pipe
        if not payload:
            return  # the parent's "no more tasks"
        fn, args = pickle.loads(payload)
        try:
            reply = (True, fn(*args), None)
        except Exception as error:  # handed to the parent, which re-raises it
            reply = (False, error, traceback.format_exc())
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # an unpicklable result or exception
            data = pickle.dumps((False, RuntimeError(f"cannot send the result back: {error!r}"), None))
        try:
            results.send_bytes(data)
        except OSError:
            return  # the parent is gone


_STOP = b""  # the empty message: the worker leaves


def _feed(connection, outbox: queue.SimpleQueue) -> None:
    """Writes one worker's pickled tasks, in order."""
    while True:
        payload = outbox.get()
        try:
            connection.send_bytes(payload)
        except OSError:
            return  # the worker died; the parent's read from it says so
        if payload == _STOP:
            return


class _Worker:
    def __init__(self, context, initializer, initargs):
        task_reader, self.tasks = context.Pipe(duplex=False)
        self.results, result_writer = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve, args=(task_reader, result_writer, initializer, initargs),
                                       daemon=True)
        self.process.start()
        # Only the worker may hold these ends: once it dies, nothing keeps its result pipe open.
        task_reader.close()
        result_writer.close()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.feeder = threading.Thread(target=_feed, args=(self.tasks, self.outbox), daemon=True)
        self.feeder.start()

    def died(self) -> WorkerDied:
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = ("still running" if code is None else f"killed by {signal.Signals(-code).name}" if code < 0
               else f"exit code {code}")
        return WorkerDied(f"worker process {self.process.pid} ended while a task was under way ({how})")


class OrderedPool:
    """`workers` spawned processes, each set up once by `initializer(*initargs)`; results in submission order."""

    def __init__(self, workers: int, initializer: Callable | None = None, initargs: tuple = ()):
        # spawn, not fork: the parent may hold tokenizer and torch thread pools, which a fork would copy in an
        # unknown state.
        context = multiprocessing.get_context("spawn")
        self._workers = [_Worker(context, initializer, initargs) for _ in range(max(1, workers))]
        self._submitted = self._returned = 0

    def in_flight(self) -> int:
        return self._submitted - self._returned

    def submit(self, fn: Callable, *args: Any) -> None:
        worker = self._workers[self._submitted % len(self._workers)]
        # Pickled here, so that a task that cannot be pickled fails in the caller.
        worker.outbox.put(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
        self._submitted += 1

    def next_result(self) -> Any:
        """The result of the oldest task not yet returned; re-raises what it raised, WorkerDied if its worker
        ended first."""
        if self._returned == self._submitted:
            raise RuntimeError("next_result() with no task in flight")
        worker = self._workers[self._returned % len(self._workers)]
        try:
            ok, value, trace = pickle.loads(worker.results.recv_bytes())
        except (EOFError, OSError):  # OSError: "got end of file during message", a worker killed mid-send
            raise worker.died() from None
        self._returned += 1
        if not ok:
            if trace:
                value.__cause__ = RemoteTraceback(trace)
            raise value
        return value

    def map(self, fn: Callable, items: Iterable[tuple], ahead: int = 2) -> Iterator[Any]:
        """fn(*item) for each item, in order, with at most `ahead` tasks per worker in flight."""
        for item in items:
            if self.in_flight() >= ahead * len(self._workers):
                yield self.next_result()
            self.submit(fn, *item)
        while self.in_flight():
            yield self.next_result()

    def close(self, kill: bool = False) -> None:
        """Stops the workers: idle ones are told to leave; with `kill` (after an error), or while results are
        still owed (a worker may be blocked writing one), they are killed at once."""
        kill = kill or self.in_flight() > 0
        for worker in self._workers:
            if kill:
                worker.process.kill()
            worker.outbox.put(_STOP)
        for worker in self._workers:
            worker.process.join(timeout=None if kill else 30)
            if worker.process.exitcode is None:
                worker.process.kill()
                worker.process.join()
            worker.feeder.join()
            worker.tasks.close()
            worker.results.close()

    def __enter__(self) -> "OrderedPool":
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close(kill=error is not None)
