# A suspect is named bad only when its deficit repeats. One rule for everything that names a node: cluster
# validation's health checks and its intra-node, pair and bisection tests (coordinator.py), and the node checks a
# training job's self-healing runs after a failed attempt (runtime/fault_tolerance/node_check.py).
#
# A first measurement marks a suspect. The suspect is measured again, REMEASURES times, and named only when every
# re-measure shows the deficit again. A suspect that measures well is a *transient* deficit: it passes, and the
# report says so with both measurements. A collective test is measured again in a group like the one it failed in
# (the node alone, or with a known-good partner) and judged against a reference group of healthy nodes measured in
# the same round where the groups are disjoint, else in the rounds just before and after (the lower of the two),
# not against the first measurement's peers: a machine or fabric that is busy for a moment slows the reference too.
# PURE: the measurements come from callbacks, so the rule is tested without processes (tests/cluster_validate/
# test_confirm.py).
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar

from csp_tools.cluster_validate.health import FAIL
from csp_tools.cluster_validate.sweep import Group, Measure, Measurement, Policy

REMEASURES = 1               # times a suspect is measured again before it is named
HEALTH_RECHECK_PAUSE_S = 5.0  # before a failed health check runs again: memory held by exiting processes, an I/O blip

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class Remeasured:
    deficit: bool   # the deficit is there again
    detail: str     # what the measurement found


@dataclass
class Confirmation:
    named: dict = field(default_factory=dict)      # key -> the first deficit and each repeat
    transient: dict = field(default_factory=dict)  # key -> the first deficit, and the measurement without it


def confirm(suspects: dict[Key, str], remeasure: Callable[[list[Key]], dict[Key, Remeasured]],
            remeasures: int = REMEASURES) -> Confirmation:
    """Name each suspect (key -> its first deficit) only when `remeasures` further measurements all repeat the
    deficit; one that measures well is transient. `remeasure(keys)` measures those keys again, all of them."""
    result = Confirmation()
    repeats: dict[Key, list[str]] = {key: [] for key in suspects}
    pending = list(suspects)
    for _ in range(remeasures):
        if not pending:
            break
        again = remeasure(list(pending))
        missing = [key for key in pending if key not in again]
        assert not missing, f"remeasure must answer every key it is given: {missing}"
        for key in pending:
            if again[key].deficit:
                repeats[key].append(again[key].detail)
            else:
                result.transient[key] = f"{suspects[key]}; transient: not repeated when measured again " \
                                        f"({again[key].detail})"
        pending = [key for key in pending if again[key].deficit]
    for key in pending:
        result.named[key] = (f"{suspects[key]}; repeated when measured again ({'; '.join(repeats[key])})"
                             if repeats[key] else suspects[key])
    return result


def recheck(first: dict, now: dict | None) -> Remeasured:
    """A failed health check (its JSON: name, status, detail) run again: `now`, None when it did not run."""
    if now is None:
        return Remeasured(True, "the check did not run")
    if now["status"] != FAIL:
        return Remeasured(False, f"{now['status']}: {now['detail']}")
    return Remeasured(True, "failed the same way" if now["detail"] == first["detail"] else f"fail: {now['detail']}")


# -- collective tests -----------------------------------------------------------------------------------------


def judge_remeasure(m: Measurement, reference: tuple[str, float] | None, policy: Policy) -> Remeasured:
    """A suspect's new measurement against the floor and (where `policy.outlier_fraction` judges relative to
    peers) the reference measured beside it: (what it was, busbw)."""
    where = ",".join(m.group)
    if not m.ok:
        return Remeasured(True, f"{where}: {m.error or 'did not complete'}")
    text = f"{where}: busbw {m.busbw:.3g} GB/s"
    if policy.floor is not None and m.busbw < policy.floor:
        return Remeasured(True, f"{text}, below the floor of {policy.floor:g} GB/s")
    if reference is not None and policy.outlier_fraction > 0:
        what, value = reference
        ratio = m.busbw / value if value > 0 else float("inf")
        relation = f"{ratio:.2f} x the {value:.3g} GB/s of {what}"
        if m.busbw < policy.outlier_fraction * value:
            return Remeasured(True, f"{text}, {relation}, below {policy.outlier_fraction:g} x")
        return Remeasured(False, f"{text}, {relation}")
    return Remeasured(False, text)


def _plan(suspects: list[str], healthy: list[str], size: int,
          with_reference: bool) -> list[tuple[list[Group], list[str]]]:
    """Rounds of disjoint groups, each with the suspects it measures: every suspect with size-1 healthy partners
    (the best first), or, with no healthy node left to partner, with other suspects; and (`with_reference`) a
    reference group of `size` healthy nodes in the same round when enough are free, else in rounds of its own just
    before and just after (a round that measures no suspect)."""
    rounds: list[tuple[list[Group], list[str]]] = []
    waiting = list(suspects)
    reference_round = ([tuple(healthy[:size])], [])
    while waiting:
        free, groups, measured = list(healthy), [], []
        if size > 1 and len(healthy) < size - 1:   # nobody healthy to partner with: suspects together
            group = tuple(waiting[:size])
            if len(group) < size:                  # the odd one out joins suspects measured already
                group += tuple(s for s in suspects if s not in group)[: size - len(group)]
            if len(group) < size:
                break
            groups.append(group)
            measured += [s for s in group if s in waiting]
        else:
            for suspect in list(waiting):
                if len(free) < size - 1:
                    break
                groups.append((suspect, *free[: size - 1]))
                free = free[size - 1:]
                measured.append(suspect)
        apart = with_reference and len(healthy) >= size and len(free) < size
        if with_reference and len(free) >= size:
            groups.append(tuple(free[:size]))
        if apart and (not rounds or rounds[-1] != reference_round):
            rounds.append(reference_round)
        rounds.append((groups, measured))
        if apart:
            rounds.append(reference_round)
        waiting = [s for s in waiting if s not in measured]
    return rounds


def remeasure_groups(suspects: list[str], healthy: list[str], measure: Measure, policy: Policy, *, size: int,
                     baseline: float | None = None) -> dict[str, Remeasured]:
    """Measure each suspect again in a group of `size` (1: the node alone; 2: with a healthy partner), beside a
    reference group of healthy nodes, and judge it (judge_remeasure) against the reference of its own round, or the
    lower of those just before and after it. `healthy` is best first. Where no reference could be measured,
    `baseline` (the healthy nodes' median in the first measurement) stands in for it."""
    plan = _plan(suspects, healthy, size, with_reference=policy.outlier_fraction > 0)
    rounds = []
    for groups, measured in plan:
        results = measure(groups)
        assert [m.group for m in results] == groups, "measure must answer every group, in order"
        rounds.append((results, measured))
    found: dict[str, Remeasured] = {}
    for i, (results, measured) in enumerate(rounds):
        if not measured:
            continue
        references = [m for m in results if not set(m.group) & set(measured) and m.ok]
        if not references:   # the reference rounds around this one
            references = [m for j in (i - 1, i + 1) if 0 <= j < len(rounds) and not rounds[j][1]
                          for m in rounds[j][0] if m.ok]
        lowest = min(references, key=lambda m: m.busbw, default=None)
        against = ((f"the healthy {'node' if size == 1 else 'group'} {','.join(lowest.group)}", lowest.busbw)
                   if lowest else ("the healthy nodes' earlier median", baseline) if baseline is not None else None)
        for m in results:
            for node in set(m.group) & set(measured):
                found[node] = judge_remeasure(m, against, policy)
    for node in suspects:
        found.setdefault(node, Remeasured(True, "no group to measure it in again"))
    return found


def median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
