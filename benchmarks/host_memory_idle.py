"""The idle worker of benchmarks/host_memory.py: the fixed process overhead of a training rank.

Run under torchrun (2 processes), as a training worker is: imports torch and the trainer (`import runtime.train`),
joins the gloo process group the way the trainer does (runtime.device.init_device), holds it for a second, then
leaves. Its peak RSS is what every rank pays before it holds a single parameter.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

# torchrun runs this file as a script: the runtime to import is the tree on PYTHONPATH, never a module beside it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import runtime.train  # noqa: E402,F401  everything a training rank imports
from runtime.device import init_device, shutdown  # noqa: E402

device = init_device("cpu")
time.sleep(1.0)
shutdown(device)
