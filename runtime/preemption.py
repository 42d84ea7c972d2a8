# Saving on a signal. Slurm sends the batch script SIGUSR1 shortly before the time limit (sbatch
# --signal=B:USR1@N, see templates/sbatch.sh.j2), the script forwards it through srun and torchrun to every
# worker; a scheduler that preempts sends SIGTERM. The handler only records the signal: the step loop finishes
# the current step, and since ranks can receive it a step apart, they agree (a one-element max all-reduce per
# step, as Megatron's signal handler does) before any of them saves, so every rank saves the same step. The
# agreed flag rides in the step's one read (runtime/step.py train_step's read_with): on XLA it is part of the step's
# graph and costs no read of its own.
from __future__ import annotations

import signal
import sys

import torch

from runtime.parallel import collectives as C
from runtime.parallel import topology
from runtime.schema.facts import PREEMPTED_EXIT_CODE  # noqa: F401 (the launcher reads it too; train.py from here)

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(Exception):
    """Raised out of the step loop once the checkpoint after a signal is committed."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"saved a checkpoint at step {step} after {signal.Signals(signum).name}")
        self.step, self.signum = step, signum


class SignalWatch:
    def __init__(self, device_tensor_device: torch.device, signals=SIGNALS):
        self.received: int | None = None
        self._device = device_tensor_device
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if self.received is None:
            print(f"nxdt: received {signal.Signals(signum).name}: saving a checkpoint at the end of the next step",
                  file=sys.stderr, flush=True)
        self.received = signum

    def flag(self) -> torch.Tensor:
        """The signal any rank received, as a one-element device tensor not yet read (collective: every rank calls
        it once per step); 0 for none."""
        flag = torch.tensor([float(self.received or 0)], device=self._device)
        if topology.world()[1] > 1:
            C.all_reduce_world(flag, op=C.MAX)
        return flag

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
