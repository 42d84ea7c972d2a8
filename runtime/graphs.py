# What the device ran, per part of the step loop: on XLA every new graph is a compile (minutes of neuronx-cc on
# Trainium) and every device-to-host transfer stalls the device, so they are counted, written to metrics.jsonl at
# each logged step, and a compile after warm-up is named on the console instead of showing only as a slow step.
#
# Parts: "step" (the training step, from its batch to the read of its loss), "validation", "save" (a checkpoint's
# copy to the host) and "logging" (a logged step's extra read: memory peaks, MoE figures). The preemption signal is
# agreed inside the step and read with it.
# The first time each part runs it may compile (warm-up); after that, the set of graphs is fixed.
from __future__ import annotations

import contextlib
import sys

from runtime.device import Device, GraphCounts

PARTS = ("step", "validation", "save", "logging")
NOTHING = GraphCounts(0, 0, 0)


class GraphAccounting:
    """Counts per part since the last logged row; does nothing on devices that run no graphs (cpu, cuda)."""

    def __init__(self, device: Device, *, is_main: bool):
        self.device, self.is_main = device, is_main
        self.enabled = device.graph_counts() is not None
        self._seen: set[str] = set()
        self._window = {part: NOTHING for part in PARTS}
        self._steps = 0
        self.recompiles = 0  # compiles after warm-up, over the run

    @contextlib.contextmanager
    def part(self, name: str, step: int):
        if not self.enabled:
            yield
            return
        before = self.device.graph_counts()
        yield
        self.device.synchronize()  # every graph the part started has run and been counted
        spent = self.device.graph_counts() - before
        self._window[name] = self._window[name] + spent
        if name == "step":
            self._steps += 1
        if spent.executions == 0 and spent.transfers == 0 and spent.compiles == 0:
            return  # the part did nothing this time (a step that saves no checkpoint): not its first run yet
        if name in self._seen and spent.compiles:
            self.recompiles += spent.compiles
            if self.is_main:
                print(f"nxdt: step {step}: {spent.compiles} new XLA graph{'s' if spent.compiles > 1 else ''} "
                      f"compiled in the {name} after warm-up (a recompile; on Neuron each is minutes of neuronx-cc): "
                      f"something the {name} traces changed shape, dtype or structure", file=sys.stderr, flush=True)
        self._seen.add(name)

    def fields(self) -> dict:
        """A logged row's figures, and a fresh window: new compiles over the window, compiles after warm-up over
        the run so far, graph executions and device-to-host transfers per training step, and each part's
        [compiles, graphs, transfers]."""
        if not self.enabled:
            return {}
        steps, step = max(self._steps, 1), self._window["step"]
        row = {"xla_compiles": sum(c.compiles for c in self._window.values()), "xla_recompiles": self.recompiles,
               "xla_graphs_per_step": step.executions / steps, "xla_transfers_per_step": step.transfers / steps,
               "xla_window": {"steps": self._steps,
                              **{part: [c.compiles, c.executions, c.transfers] for part, c in self._window.items()}}}
        self._window = {part: NOTHING for part in PARTS}
        self._steps = 0
        return row
