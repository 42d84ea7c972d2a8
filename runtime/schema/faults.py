# Fault injection for tests of the self-healing job (docs/fault_tolerance.md): one environment variable, which
# reaches every worker of a Slurm job as Slurm passes the submitting environment on, names one fault.
#
#   NXDT_INJECT_FAULT=exit:rank=1:step=12         rank 1 exits non-zero as step 12 begins
#   NXDT_INJECT_FAULT=hang:rank=1:step=12         rank 1 stops making progress there (sleeps for ever)
#   NXDT_INJECT_FAULT=hang:rank=1:step=12:section=checkpoint   ... inside step 12's checkpoint save
#   NXDT_INJECT_FAULT=sleep:rank=0:step=1:seconds=20           a slow section, not a hung one (the first step's
#                                                              compile, simulated): it goes on after 20 s
#   NXDT_INJECT_FAULT=unhealthy:node=node2        node2's health checks fail (the training preflight, and the
#                                                 node checks the job then runs)
#   NXDT_INJECT_FAULT=lost:node=node2:step=12     node2 is lost as step 12's save begins (after its update): its
#                                                 workers, their torchrun and its peer store are killed (SIGKILL),
#                                                 and its health checks fail for the rest of the allocation
#
# A fault fires once per run: the worker that fires it creates <results_dir>/.nxdt_fault_fired first, and a
# restarted or requeued job finds it there. An unhealthy node stays unhealthy for the rest of the allocation that
# found it (its node checks must see what its preflight saw). Parsed here, torch-free, so that the launcher
# refuses a malformed value before submitting and the runtime reads it the same way.
from __future__ import annotations

from dataclasses import dataclass

ENV = "NXDT_INJECT_FAULT"
KINDS = ("exit", "hang", "sleep", "unhealthy", "lost")
SECTIONS = ("data", "step", "validation", "checkpoint")  # where a worker reports progress (progress.py)
FIRED = ".nxdt_fault_fired"
_FORMS = ("exit:rank=R:step=S, hang:rank=R:step=S[:section=checkpoint], sleep:rank=R:step=S:seconds=N, "
          "unhealthy:node=NAME or lost:node=NAME:step=S")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    section: str = "step"
    seconds: float = 0.0
    node: str | None = None

    def __str__(self) -> str:
        if self.kind == "unhealthy":
            return f"unhealthy:node={self.node}"
        if self.kind == "lost":
            return f"lost:node={self.node}:step={self.step}"
        text = f"{self.kind}:rank={self.rank}:step={self.step}"
        if self.section != "step":
            text += f":section={self.section}"
        return text + (f":seconds={self.seconds:g}" if self.kind == "sleep" else "")


def parse(value: str) -> tuple[Fault | None, str | None]:
    """(the fault, None), or (None, one line naming the variable and the forms it takes). Empty: no fault."""
    value = (value or "").strip()
    if not value:
        return None, None
    kind, *fields = value.split(":")

    def bad(why: str) -> tuple[None, str]:
        return None, f"{ENV}={value!r}: {why}; use {_FORMS}"

    if kind not in KINDS:
        return bad(f"unknown fault {kind!r}")
    args: dict[str, str] = {}
    for field in fields:
        name, sep, text = field.partition("=")
        if not sep or not text or name in args:
            return bad(f"{field!r} is not name=value (or repeats a name)")
        args[name] = text
    allowed = {"unhealthy": {"node"}, "lost": {"node", "step"}, "sleep": {"rank", "step", "section", "seconds"}}.get(
        kind, {"rank", "step", "section"})
    required = {"unhealthy": {"node"}, "lost": {"node", "step"}, "sleep": {"rank", "step", "seconds"}}.get(
        kind, {"rank", "step"})
    if set(args) - allowed or required - set(args):
        return bad(f"a {kind} fault takes {', '.join(sorted(required))}"
                   + (f" (and {', '.join(sorted(allowed - required))})" if allowed - required else ""))
    if kind == "unhealthy":
        return Fault(kind, node=args["node"]), None
    if kind == "lost":
        step = int(args["step"]) if args["step"].isdigit() else 0
        if step < 1:
            return bad("step is a whole number >= 1 (the first step is 1)")
        return Fault(kind, step=step, section="checkpoint", node=args["node"]), None
    try:
        rank, step = int(args["rank"]), int(args["step"])
        seconds = float(args.get("seconds", 0))
    except ValueError:
        return bad("rank and step are whole numbers, seconds a number")
    if rank < 0 or step < 1 or seconds < 0:
        return bad("rank >= 0, step >= 1 (the first step is 1), seconds >= 0")
    section = args.get("section", "step")
    if section not in SECTIONS:
        return bad(f"section {section!r} is not one of {', '.join(SECTIONS)}")
    return Fault(kind, rank=rank, step=step, section=section, seconds=seconds), None
