# Which nodes are bad, decided from collective measurements. PURE: every function takes a `measure` callback
# that runs a list of disjoint node groups at once and returns one Measurement per group, so the logic is
# tested with synthetic measurements (tests/cluster_validate/test_sweep.py) and driven by real collectives in
# coordinator.py.
#
# Why pairs need more than one round: a pair is as slow as its slower node, so one slow node makes its partner
# look slow too, and with few nodes the median is no reference (with 3 nodes and the slow one in the first pair,
# the only pair measured is slow). So every node is tested with two different partners before anything is judged
# (round 1 pairs side by side; later rounds give each node a new partner, the odd node out first, joined with the
# best node measured so far). A node is then judged by its BEST pair: it fails on the absolute floor, or as an
# outlier below `outlier_fraction` x the median of its peers' best. A failing node is named only when it failed
# together with partners that all passed; otherwise it is retested with a known-good node (the bisection of a
# failing pair). A node that fails with every partner and never met a good one is named with that explanation.
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

Group = tuple[str, ...]


@dataclass(frozen=True)
class Measurement:
    group: Group
    busbw: float | None          # GB/s of the judged operation and size; None when the test did not complete
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.busbw is not None


Measure = Callable[[list[Group]], list[Measurement]]


@dataclass(frozen=True)
class Policy:
    floor: float | None = None        # absolute busbw floor, GB/s (per instance type, from the config)
    outlier_fraction: float = 0.7     # fail below this fraction of the median of the peers
    max_rounds: int = 12
    min_peers: int = 2                # with one peer there is no telling which of the two is the odd one


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


@dataclass
class SweepResult:
    verdicts: dict[str, Verdict]
    rounds: list[list[Measurement]] = field(default_factory=list)

    @property
    def bad(self) -> list[str]:
        return [node for node, verdict in self.verdicts.items() if not verdict.passed]


def judge(scores: dict[str, float | None], policy: Policy) -> dict[str, Verdict]:
    """Each node's score (best busbw, None: never completed a test) against the floor and its peers' median."""
    verdicts = {}
    for node, score in scores.items():
        peers = [s for other, s in scores.items() if other != node and s is not None]
        if score is None:
            verdicts[node] = Verdict(False, "no test completed")
        elif policy.floor is not None and score < policy.floor:
            verdicts[node] = Verdict(False, f"busbw {score:.3g} GB/s is below the floor of {policy.floor:g} GB/s")
        elif len(peers) >= policy.min_peers and score < policy.outlier_fraction * statistics.median(peers):
            median = statistics.median(peers)
            verdicts[node] = Verdict(False, f"busbw {score:.3g} GB/s is below {policy.outlier_fraction:g} x the "
                                            f"median of its peers ({median:.3g} GB/s)")
        else:
            verdicts[node] = Verdict(True, f"busbw {score:.3g} GB/s")
    return verdicts


class _History:
    def __init__(self, nodes: list[str], measure: Measure):
        self.nodes, self.measure = nodes, measure
        self.rounds: list[list[Measurement]] = []
        self.partners: dict[str, set[str]] = {n: set() for n in nodes}

    def run(self, groups: list[Group]) -> None:
        measured = self.measure(groups)
        assert [m.group for m in measured] == groups, "measure must answer every group, in order"
        self.rounds.append(measured)
        for m in measured:
            for node in m.group:
                self.partners[node] |= set(m.group) - {node}

    def tests_of(self, node: str) -> list[Measurement]:
        return [m for r in self.rounds for m in r if node in m.group]

    def scores(self) -> dict[str, float | None]:
        best = {}
        for node in self.nodes:
            done = [m.busbw for m in self.tests_of(node) if m.ok]
            best[node] = max(done) if done else None
        return best


def _coverage_round(history: _History, target: int) -> list[Group]:
    """Pairs that give nodes with fewer than `target` partners a new one: a partner that also needs one if
    possible, else the best-scoring node (the known-good one the odd node out is joined with)."""
    index = {n: i for i, n in enumerate(history.nodes)}
    scores = history.scores()
    needy = sorted((n for n in history.nodes if len(history.partners[n]) < target),
                   key=lambda n: (len(history.partners[n]), index[n]))
    used: set[str] = set()
    pairs = []
    for node in needy:
        if node in used:
            continue
        free = [m for m in history.nodes if m != node and m not in used and m not in history.partners[node]]
        if not free:
            continue
        partner = min(free, key=lambda m: (m not in needy, -(scores[m] or 0.0), index[m]))
        pairs.append((node, partner))
        used |= {node, partner}
    return pairs


def _resolution_round(history: _History, unresolved: list[str], good: list[str]) -> list[Group]:
    """Each unresolved node with a known-good partner (none of its partners so far passed); with no good node
    anywhere, with any node it has not met yet."""
    scores = history.scores()
    used: set[str] = set()
    pairs = []
    for node in unresolved:
        if node in used:
            continue
        pool = [m for m in good if m not in used]
        if not pool:
            pool = [m for m in history.nodes if m != node and m not in used and m not in history.partners[node]]
        if not pool:
            continue
        partner = max(pool, key=lambda m: scores[m] or 0.0)
        pairs.append((node, partner))
        used |= {node, partner}
    return pairs


def pair_sweep(nodes: list[str], measure: Measure, policy: Policy) -> SweepResult:
    """Name the bad nodes among `nodes` from pair tests run in parallel rounds."""
    nodes = list(dict.fromkeys(nodes))
    if len(nodes) < 2:
        return SweepResult({n: Verdict(True, "no partner to test with") for n in nodes})
    history = _History(nodes, measure)
    history.run([(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)])
    target = min(2, len(nodes) - 1)
    while len(history.rounds) < policy.max_rounds:
        pairs = _coverage_round(history, target)
        if not pairs:
            break
        history.run(pairs)

    while True:
        verdicts = judge(history.scores(), policy)
        good = [n for n in nodes if verdicts[n].passed]
        confirmed = {}
        for node in nodes:
            if verdicts[node].passed:
                continue
            with_good = [m for m in history.tests_of(node) if all(verdicts[o].passed for o in m.group if o != node)]
            if with_good:
                partners = sorted({o for m in with_good for o in m.group if o != node})
                confirmed[node] = f"{verdicts[node].reason}; also with known-good {', '.join(partners)}"
        unresolved = [n for n in nodes if not verdicts[n].passed and n not in confirmed]
        if not unresolved or len(history.rounds) >= policy.max_rounds:
            break
        pairs = _resolution_round(history, unresolved, good)
        if not pairs:
            break
        history.run(pairs)

    final = {}
    for node in nodes:
        if verdicts[node].passed:
            final[node] = verdicts[node]
        elif node in confirmed:
            final[node] = Verdict(False, confirmed[node])
        else:
            met = ", ".join(sorted(history.partners[node])) or "none"
            final[node] = Verdict(False, f"{verdicts[node].reason}; failed with every partner tested ({met}) and "
                                         "no known-good node was left to tell them apart")
    return SweepResult(final, history.rounds)


@dataclass
class BisectResult:
    named: dict[str, str]                        # node -> why
    notes: list[str] = field(default_factory=list)  # failures that no single node explains
    rounds: list[list[Measurement]] = field(default_factory=list)


def bisect(group: Group, measure: Measure, passes: Callable[[Measurement], bool], *,
           known_good: tuple[str, ...] = (), max_rounds: int = 12) -> BisectResult:
    """`group` failed as a whole: test its halves in parallel, then the failing halves' halves, until single
    nodes are named. A one-node half cannot run a collective alone: it is tested with a known-good node (from
    `known_good` or from a half that passed) as soon as one is free. While none is known, it is tried with a
    node of the group it has not met: a pass makes both known-good, a failure proves nothing and it waits."""
    good = set(known_good)
    met: dict[str, set[str]] = {n: set() for n in group}
    result = BisectResult({})
    failing: list[Group] = [tuple(group)]
    pending: list[Group] = []
    parent: dict[Group, Group] = {}
    while len(result.rounds) < max_rounds:
        for s in failing:
            if len(s) == 1:
                result.named[s[0]] = "failed with known-good partners while the rest of its set passed"
                continue
            for half in (s[: len(s) // 2], s[len(s) // 2:]):
                parent[half] = s
                pending.append(half)
        failing = []
        plan: list[tuple[Group, Group, bool]] = []   # (part, test group, does a failure name the part?)
        busy: set[str] = set()
        deferred: list[Group] = []
        for part in pending:
            test, conclusive = part, True
            if len(part) == 1:
                node = part[0]
                partner = next((g for g in sorted(good) if g not in busy and g != node), None)
                if partner is None:
                    conclusive = False
                    partner = next((g for g in group if g not in busy and g != node and g not in met[node]), None)
                test = (node, partner) if partner else ()
            if not test or busy & set(test):
                deferred.append(part)
                continue
            plan.append((part, test, conclusive))
            busy |= set(test)
        pending = deferred
        if not plan:
            break
        measured = measure([test for _, test, _ in plan])
        result.rounds.append(measured)
        for (part, test, conclusive), m in zip(plan, measured):
            for node in test:
                met.setdefault(node, set()).update(set(test) - {node})
            if passes(m):
                good |= set(test)
            elif conclusive:
                failing.append(part)
            else:
                pending.append(part)
        tested_parents = {parent[part] for part, _, _ in plan if part in parent}
        for s in tested_parents:
            children = [p for p, q in parent.items() if q == s]
            if all(set(c) <= good for c in children):
                result.notes.append(f"{', '.join(s)} failed together although each half passed")
        if not failing and not pending:
            break
    for part in failing:
        if len(part) == 1:
            result.named[part[0]] = "failed with known-good partners while the rest of its set passed"
        else:
            pending.append(part)
    for part in pending:
        result.notes.append(f"{', '.join(part)}: not isolated (no known-good node free, or out of rounds)")
    return result
