"""Training runs on XLA:CPU, in turn in one process, whose asynchronous saves are each held at their first write until
the next update has brought part of the state into the ring (the save is in flight while the next step is traced,
every time):

    python -m tests.runtime_xla.gated_save MODE OUT.json CONFIG.yaml [MODE OUT.json CONFIG.yaml ...]

    MODE streamed: the streamed save (the runtime's own)
    MODE whole:    the whole host copy at the save, as before issue 56 (HostStaging): a reference

OUT.json: per streamed save, what the update staged and how many buffers it transferred; the writers' transfers over
the run; and, where NXDT_XLA_CACHE_DIR names XLA's persistent cache, its entries when the run ended (the runs after
it reuse this process's compiled graphs, and may add their own).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from unittest import mock

from runtime.checkpoint import rankfile, staging
from runtime.config import load_training_config
from runtime.device import Device, XlaTransfer, init_device, shutdown
from runtime.train import train


@contextlib.contextmanager
def _saves(mode: str, snapshots: list):
    """The run's save path: the whole host copy, or the streamed one with each save held at its first write."""
    if mode == "whole":
        with mock.patch.object(Device, "defers_staging_copy", property(lambda self: False)):
            yield
        return
    if mode != "streamed":
        raise ValueError(f"unknown mode {mode!r}: streamed or whole")
    init, write, held = staging.StreamedSnapshot.__init__, rankfile._pwrite_all, set()

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        snapshots.append(self)

    def gated(fd, data, offset):
        snapshot = snapshots[-1]
        if threading.current_thread() is not threading.main_thread() and id(snapshot) not in held:
            held.add(id(snapshot))
            deadline = time.monotonic() + 120
            while snapshot.staged_bytes == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        write(fd, data, offset)

    with mock.patch.object(staging.StreamedSnapshot, "__init__", recording), \
            mock.patch.object(rankfile, "_pwrite_all", gated):
        yield


def main(args: list[str]) -> int:
    runs = [(args[i], args[i + 1], load_training_config(args[i + 2])) for i in range(0, len(args), 3)]
    device = init_device(runs[0][2].trainer.accelerator)
    cache = os.environ.get("NXDT_XLA_CACHE_DIR")
    try:
        for mode, out, cfg in runs:
            snapshots: list = []
            transfers = XlaTransfer.transfers
            with _saves(mode, snapshots):
                train(cfg, device)
            with open(out, "w") as f:
                json.dump({"staged": [s.staged_bytes for s in snapshots], "buffers": [len(s._units) for s in snapshots],
                           "writer_transfers": XlaTransfer.transfers - transfers,
                           "cache": sorted(os.listdir(cache)) if cache else None}, f)
    finally:
        shutdown(device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
