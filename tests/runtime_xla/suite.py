"""Several training configs in one launch: the XLA tests' two-process layouts in one torchrun launch on XLA:CPU,
their single-process XLA runs in one process, and their CPU references in another (conftest.py):

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.runtime_xla.suite A.yaml B.yaml ...
    python -m tests.runtime_xla.suite A.yaml B.yaml ...

Each process imports torch (and torch-xla: ~11 s of CPU together, torch alone ~4 s) and joins the world once, then
trains each config in turn with the runtime's own train(), the function `python -m runtime.train` runs between
the same init_device and shutdown (each config's losses are bit for bit those of a process of its own). Every
config gets its own topology, model, data and results directory; the layouts differ, the world (devices,
collectives) does not.
"""
from __future__ import annotations

import sys

from runtime.config import load_training_config
from runtime.device import init_device, shutdown
from runtime.train import train


def main(paths: list[str]) -> int:
    configs = [load_training_config(path) for path in paths]
    if len({(c.trainer.accelerator, c.trainer.num_nodes * c.trainer.devices) for c in configs}) != 1:
        raise ValueError("the configs of one launch must share trainer.accelerator and the world size")
    device = init_device(configs[0].trainer.accelerator)
    clean = False
    try:
        for cfg in configs:
            train(cfg, device)
            device.barrier()  # the next layout builds its groups on every rank together
        clean = True
    finally:
        shutdown(device, drain=clean)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
