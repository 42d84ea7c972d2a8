"""Loads the FAKE accelerator (tests/titan/cpu_shim.py) in every Python process started with this folder on
PYTHONPATH and NXDT_TITAN_CPU_SHIM=1: torchrun's workers of the tests in tests/titan, which run torchtitan on CPU."""
import os
import sys

if os.environ.get("NXDT_TITAN_CPU_SHIM") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cpu_shim

    cpu_shim.install()
