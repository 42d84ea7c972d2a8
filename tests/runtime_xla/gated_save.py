"""One training run on XLA:CPU whose asynchronous saves are each held at their first write until the next update
has brought part of the state into the ring (the save is in flight while the next step is traced, every time):

    python -m tests.runtime_xla.gated_save streamed OUT.json CONFIG.yaml   the streamed save (the runtime's own)
    python -m tests.runtime_xla.gated_save whole OUT.json CONFIG.yaml      the whole host copy at the save, as
                                                                           before issue 56 (HostStaging): a reference

OUT.json: per streamed save, what the update staged and how many buffers it transferred; the writers' transfers.
"""
from __future__ import annotations

import json
import sys
import threading
import time

from runtime.checkpoint import rankfile, staging
from runtime.config import load_training_config
from runtime.device import Device, XlaTransfer, init_device, shutdown
from runtime.train import train


def main(mode: str, out: str, config: str) -> int:
    reference = {"streamed": False, "whole": True}[mode]
    snapshots: list = []
    if reference:
        Device.defers_staging_copy = property(lambda self: False)
    else:
        init = staging.StreamedSnapshot.__init__

        def recording(self, *args, **kwargs):
            init(self, *args, **kwargs)
            snapshots.append(self)

        write, held = rankfile._pwrite_all, set()

        def gated(fd, data, offset):
            snapshot = snapshots[-1]
            if threading.current_thread() is not threading.main_thread() and id(snapshot) not in held:
                held.add(id(snapshot))
                deadline = time.monotonic() + 120
                while snapshot.staged_bytes == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)
            write(fd, data, offset)

        staging.StreamedSnapshot.__init__ = recording
        rankfile._pwrite_all = gated
    cfg = load_training_config(config)
    device = init_device(cfg.trainer.accelerator)
    try:
        train(cfg, device)
    finally:
        shutdown(device)
    with open(out, "w") as f:
        json.dump({"staged": [s.staged_bytes for s in snapshots], "buffers": [len(s._units) for s in snapshots],
                   "writer_transfers": XlaTransfer.transfers}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
