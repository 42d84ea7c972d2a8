# The coordinator, on node 0: runs the phases over the agents and writes the report.
#
#   1. register   every agent says where it is; one that does not within register_timeout_s fails
#   2. clock      NTP-style exchanges with each agent (offset ± half the round trip)
#   3. health     each node's own checks, then versions and clock compared across nodes
#   4. intra-node each healthy node alone, over its devices (skipped with one device per node); nccom-test too
#   5. pairs      sweep.pair_sweep over the nodes still good, each round's pairs in parallel
#   6. all nodes  one test over every good node; if it fails, sweep.bisect names the node
#
# A node that fails a health check or a test is a suspect, named only when its deficit repeats (confirm.py): its
# failed checks run again, its test runs again beside a healthy reference. One that passes then is reported as a
# transient deficit, and passes.
#
# A test is a "task": node 0 publishes which agent joins which group (task/<n>), the agents' workers join the
# group through this store under a prefix of their own, and each agent answers result/<n>/<rank>.
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from csp_tools.cluster_validate import health, report
from csp_tools.cluster_validate.bandwidth import Row, judged_size, sweep_sizes
from csp_tools.cluster_validate.confirm import (HEALTH_RECHECK_PAUSE_S, Confirmation, Remeasured, confirm,
                                                median_or_none, recheck, remeasure_groups)
from csp_tools.cluster_validate.sweep import Measurement, Policy, bisect, judge, pair_sweep


@dataclass(frozen=True)
class NodeInfo:
    rank: int
    name: str
    address: str


@dataclass
class Findings:
    """What the run has found, by node name: why a node fails (reasons), the deficits that did not repeat
    (transient), its health checks and facts, and the busbw each phase measured for it."""
    reasons: dict[str, list[str]]
    transient: dict[str, list[str]] = field(default_factory=dict)
    checks: dict[str, list[health.Check]] = field(default_factory=dict)
    facts: dict[str, dict] = field(default_factory=dict)
    busbw: dict[str, dict] = field(default_factory=dict)

    def settle(self, found: Confirmation) -> None:
        """The suspects a confirmation named fail; those it found transient pass, with a note."""
        for name, why in found.named.items():
            self.reasons[name].append(why)
        for name, why in found.transient.items():
            self.transient[name].append(why)


class Coordinator:
    def __init__(self, cfg, control, ident, log=print):
        self.cfg, self.control, self.ident = cfg, control, ident
        self.log = lambda *a: log(*a, flush=True)
        c = cfg.collectives
        self.sizes = sweep_sizes(c.min_bytes, c.max_bytes, c.step_factor)
        self.judge_size = judged_size(self.sizes, cfg.sweep.judge_bytes)
        self.seq = 0
        self.tests: list[dict] = []
        self.notes: list[str] = []
        self.by_name: dict[str, NodeInfo] = {}

    # -- control plane -------------------------------------------------------------------------------------
    def _get(self, key: str, deadline: float):
        try:
            return self.control.get(key, deadline - time.monotonic())
        except Exception:  # noqa: BLE001 - torch raises several store errors; all mean "not in time"
            return None

    def _register(self) -> tuple[list[NodeInfo], dict[str, str]]:
        deadline = time.monotonic() + self.cfg.register_timeout_s
        nodes, missing = [], {}
        for rank in range(self.ident.nodes):
            found = self._get(f"node/{rank}", deadline)
            hinted = self.ident.hostnames[rank] if rank < len(self.ident.hostnames) else f"rank{rank}"
            if found is None:
                missing[hinted] = f"its agent did not register within {self.cfg.register_timeout_s:g}s"
            else:
                nodes.append(NodeInfo(rank, found["name"], found["address"]))
        return nodes, missing

    def _serve_clock(self, nodes: list[NodeInfo]) -> None:
        for node in nodes:
            for k in range(3):
                if self._get(f"clock/q/{node.rank}/{k}", time.monotonic() + 30) is None:
                    break
                self.control.put(f"clock/a/{node.rank}/{k}", time.time())

    # -- tests ---------------------------------------------------------------------------------------------
    def run_groups(self, groups: list[tuple[str, ...]], operations, phase: str, kind: str = "collectives"):
        seq, self.seq = self.seq, self.seq + 1
        cfg, devices = self.cfg, self.cfg.devices
        assign = {}
        for gi, group in enumerate(groups):
            leader = self.by_name[group[0]]
            for ni, name in enumerate(group):
                if kind == "nccom":
                    assign[str(self.by_name[name].rank)] = {"kind": "nccom", "operations": list(operations)}
                    continue
                assign[str(self.by_name[name].rank)] = {
                    "kind": "collectives", "first_rank": ni * devices, "report": ni == 0,
                    "leader_address": leader.address, "master_port": self.control.port + 1 + (seq * 31 + gi) % 2000,
                    "task": {"prefix": f"t{seq}/g{gi}/", "world": len(group) * devices, "backend": cfg.backend,
                             "operations": list(operations), "sizes": self.sizes,
                             "dtype": cfg.collectives.dtype, "warmup": cfg.collectives.warmup_iters,
                             "iters": cfg.collectives.iters, "check": cfg.collectives.check,
                             "timeout_s": cfg.collectives.timeout_s},
                }
        self.control.put(f"task/{seq}", {"kind": "run", "assign": assign})
        deadline = time.monotonic() + cfg.task_timeout_s + 30
        replies = {}
        for rank in assign:
            replies[rank] = self._get(f"result/{seq}/{rank}", deadline) or {
                "ok": False, "rows": [], "errors": [f"no answer within {cfg.task_timeout_s + 30:g}s"]}
        results = []
        for group in groups:
            ranks = [str(self.by_name[n].rank) for n in group]
            rows = [Row.from_json(r) for r in replies[ranks[0]].get("rows") or []]
            errors = [f"{name}: {e}" for name, r in zip(group, ranks) for e in replies[r].get("errors") or []]
            test = {"phase": phase, "round": seq, "group": list(group), "backend": cfg.backend,
                    "ranks": (devices if kind == "nccom" else len(group) * devices),
                    "source": "nccom-test" if kind == "nccom" else "torch.distributed",
                    "rows": [row.to_json() for row in rows], "errors": errors}
            test["judged"] = self._judged(test)
            self.tests.append(test)
            results.append(test)
            self.log(report.test_text(test))
        return results

    def _judged(self, test: dict) -> dict:
        """The judged operation at the judged size: busbw, or why the test failed."""
        op, error, busbw = self.cfg.sweep.operation, None, None
        if test["errors"]:
            error = test["errors"][0]
        for row in test["rows"]:
            if error is None and row["wrong"]:
                error = f"{row['wrong']} wrong element(s) in {row['operation']} at {row['size']} B"
            if error is None and row.get("error"):
                error = row["error"]
            if row["operation"] == op and row["size"] <= self.judge_size:
                busbw = row["busbw"]  # rows come in size order: the last one at or below judge_size
        if error is None and busbw is None and test["source"] != "nccom-test":
            error = f"no {op} result"
        return {"operation": op, "size": self.judge_size, "busbw": busbw, "error": error}

    def _measure(self, phase: str, operations=None):
        def measure(groups):
            return [Measurement(tuple(t["group"]), t["judged"]["busbw"], t["judged"]["error"])
                    for t in self.run_groups(groups, operations or self.cfg.sweep.pair_operations, phase)]
        return measure

    def _confirm_tests(self, phase: str, suspects: dict[str, str], healthy: list[str], policy: Policy, *,
                       size: int, operations=None, baseline: float | None = None) -> Confirmation:
        """The suspects of a collective test, measured again (phase '<phase> recheck') beside a healthy reference."""
        measure = self._measure(f"{phase} recheck", operations)
        return confirm(suspects, lambda nodes: remeasure_groups(nodes, healthy, measure, policy, size=size,
                                                                baseline=baseline))

    def _recheck_health(self, keys: list[tuple[str, str]], first: dict[str, list[health.Check]]
                        ) -> dict[tuple[str, str], Remeasured]:
        """The failed health checks (node, check name) run again on their nodes, after a pause; `first`: each
        node's checks the first time."""
        time.sleep(HEALTH_RECHECK_PAUSE_S)
        seq, self.seq = self.seq, self.seq + 1
        names = sorted({node for node, _ in keys})
        self.control.put(f"task/{seq}", {"kind": "run", "assign": {str(self.by_name[n].rank): {"kind": "health"}
                                                                   for n in names}})
        deadline = time.monotonic() + self.cfg.health.timeout_s * 4 + 60
        again = {}
        for name in names:
            got = self._get(f"result/{seq}/{self.by_name[name].rank}", deadline) or {}
            again[name] = {c["name"]: c for c in got.get("checks") or []}
        found = {}
        for node, check in keys:
            before = next(c.to_json() for c in first[node] if c.name == check)
            found[(node, check)] = (recheck(before, again[node].get(check)) if again[node]
                                    else Remeasured(True, "no health report in time"))
        return found

    def _floor(self, floors, which: str) -> float | None:
        value = getattr(floors, which)
        if value is not None and self.judge_size < floors.at_bytes:
            self.notes.append(f"{which} floor {value:g} GB/s not applied: it is for {floors.at_bytes} B and the "
                              f"judged size is {self.judge_size} B (raise collectives.max_bytes)")
            return None
        return value

    # -- the run -------------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg, started = self.cfg, datetime.now(timezone.utc)
        self.log(f"cluster validation: waiting for {self.ident.nodes} node(s) on "
                 f"{self.control.host}:{self.control.port}")
        nodes, missing = self._register()
        self.by_name = {n.name: n for n in nodes}
        found = Findings(reasons={n.name: [] for n in nodes})
        found.reasons.update({name: [why] for name, why in missing.items()})
        self._serve_clock(nodes)
        self._health(nodes, found)

        types = sorted({f["instance_type"] for f in found.facts.values()}) or ["unknown"]
        instance_type = types[0]
        if len(types) > 1:
            self.notes.append(f"mixed instance types {', '.join(types)}: thresholds of {instance_type} applied")
        floors = cfg.floors_for(instance_type)
        found.busbw = {n.name: {} for n in nodes}

        good = [n.name for n in nodes if not found.reasons[n.name]]
        if cfg.sweep.intra_node and cfg.devices > 1 and good:
            self._intra_node(good, floors, found)
        if cfg.accelerator == "neuron" and cfg.nccom_test.enabled != "false" and good:
            self._nccom_test(good, found)
        good = [n for n in good if not found.reasons[n]]
        self._pairs(good, floors, found)
        good = [n for n in good if not found.reasons[n]]
        if cfg.sweep.all_nodes and len(good) >= 2:
            self._all_nodes(good, floors, found)

        data = self._report(started, nodes, missing, instance_type, floors, found)
        path = report.write(data, cfg.results_dir)
        self.log(report.verdict_text(data))
        self.log(f"report: {path}")
        self._finish(nodes)
        return 0 if data["passed"] else 1

    def _health(self, nodes: list[NodeInfo], found: Findings) -> None:
        """Phase 3: each node's own checks (node 0 writes the shared-path markers they look for), its failed ones
        run again; then versions and clocks compared across the nodes that answered."""
        cfg = self.cfg
        token = secrets.token_hex(8)
        for path in cfg.health.shared_paths:
            try:
                health.marker_path(path, token).parent.mkdir(parents=True, exist_ok=True)
                health.marker_path(path, token).write_text(token + "\n")
            except OSError:
                pass  # node 0's own shared-path check reports it
        self.control.put("health/start", {"token": token})
        checks, facts, offsets = found.checks, found.facts, {}
        deadline = time.monotonic() + cfg.health.timeout_s * 4 + 60
        for node in nodes:
            got = self._get(f"health/{node.rank}", deadline)
            if got is None:
                checks[node.name] = [health.Check("health", health.FAIL, "no health report in time")]
                continue
            checks[node.name] = [health.Check(**c) for c in got["checks"]]
            facts[node.name], offsets[node.name] = got["facts"], tuple(got["clock"])
        # A node's own failed checks run again before they name it (node 0's markers are still there).
        found.transient = {name: [] for name in found.reasons}
        rechecked = confirm({(name, c.name): f"{c.name}: {c.detail}" for name in facts for c in checks[name]
                             if c.status == health.FAIL}, lambda keys: self._recheck_health(keys, checks))
        for name, check in health.compare_versions({n: f["versions"] for n, f in facts.items()}).items():
            checks[name].append(check)
        for name, check in health.clock_checks(offsets, cfg.health.max_clock_skew_s).items():
            checks[name].append(check)
        for path in cfg.health.shared_paths:
            health.marker_path(path, token).unlink(missing_ok=True)
        for name, node_checks in checks.items():
            for c in node_checks:
                if (name, c.name) in rechecked.transient:
                    found.transient[name].append(rechecked.transient[(name, c.name)])
                elif c.status == health.FAIL:
                    found.reasons[name].append(rechecked.named.get((name, c.name), f"{c.name}: {c.detail}"))

    def _intra_node(self, good: list[str], floors, found: Findings) -> None:
        """Phase 4: each good node alone, over its devices; the suspects measured again beside the fastest."""
        cfg, busbw = self.cfg, found.busbw
        tests = self.run_groups([(n,) for n in good], cfg.collectives.operations, "intra_node")
        policy = Policy(self._floor(floors, "intra_node"), cfg.sweep.outlier_fraction)
        verdicts = judge({t["group"][0]: (t["judged"]["busbw"] if t["judged"]["error"] is None else None)
                          for t in tests}, policy)
        suspects = {}
        for t in tests:
            name = t["group"][0]
            busbw[name]["intra_node_busbw"] = t["judged"]["busbw"]
            if not verdicts[name].passed:
                suspects[name] = f"intra-node {t['judged']['error'] or verdicts[name].reason}"
        healthy = sorted((n for n in verdicts if verdicts[n].passed),
                         key=lambda n: -(busbw[n]["intra_node_busbw"] or 0.0))
        found.settle(self._confirm_tests(
            "intra_node", suspects, healthy, policy, size=1, operations=cfg.collectives.operations,
            baseline=median_or_none(busbw[n]["intra_node_busbw"] for n in healthy)))

    def _nccom_test(self, good: list[str], found: Findings) -> None:
        """Phase 4, on Neuron: nccom-test on each good node; a failure names the node."""
        cfg = self.cfg
        # auto: where nccom-test is installed; true: everywhere (a node without it then fails)
        have = [n for n in good if cfg.nccom_test.enabled == "true" or found.facts[n]["tools"].get("nccom-test")]
        tests = self.run_groups([(n,) for n in have], cfg.collectives.operations, "nccom-test", kind="nccom") \
            if have else []
        for t in tests:
            if t["judged"]["error"]:
                found.reasons[t["group"][0]].append(f"nccom-test: {t['judged']['error']}")

    def _pairs(self, good: list[str], floors, found: Findings) -> None:
        """Phase 5: sweep.pair_sweep over the good nodes; the suspects measured again beside the fastest."""
        cfg, busbw = self.cfg, found.busbw
        policy = Policy(self._floor(floors, "pair") if len(good) > 1 else None, cfg.sweep.outlier_fraction,
                        cfg.sweep.max_rounds)
        swept = pair_sweep(good, self._measure("pair"), policy)
        suspects = {}
        for name, verdict in swept.verdicts.items():
            scores = [t["judged"]["busbw"] for t in self.tests if t["phase"] == "pair" and name in t["group"]
                      and t["judged"]["error"] is None]
            busbw[name]["pair_busbw"] = max(scores) if scores else None
            if not verdict.passed:
                suspects[name] = f"pairs: {verdict.reason}"
        healthy = sorted((n for n in good if swept.verdicts[n].passed), key=lambda n: -(busbw[n]["pair_busbw"] or 0.0))
        found.settle(self._confirm_tests("pair", suspects, healthy, policy, size=2,
                                         baseline=median_or_none(busbw[n]["pair_busbw"] for n in healthy)))

    def _all_nodes(self, good: list[str], floors, found: Findings) -> None:
        """Phase 6: one test over every good node; if it fails, sweep.bisect names the node."""
        cfg = self.cfg
        floor = self._floor(floors, "all_nodes")

        def passes(m: Measurement) -> bool:
            return m.ok and (floor is None or m.busbw >= floor)

        (whole,) = self.run_groups([tuple(good)], cfg.collectives.operations, "all_nodes")
        j = whole["judged"]
        if not passes(Measurement(tuple(good), j["busbw"], j["error"])):
            why = j["error"] or f"busbw {j['busbw']:.3g} GB/s is below the floor of {floor:g} GB/s"
            self.notes.append(f"the test over all {len(good)} good nodes failed ({why}); bisecting")
            bisected = bisect(tuple(good), self._measure("bisect"), passes, max_rounds=cfg.sweep.max_rounds)
            self.notes += bisected.notes
            # judged as the bisection judges (an error, the floor), so no relative reference is measured
            found.settle(self._confirm_tests("bisect", {n: f"bisection: {why}" for n, why in bisected.named.items()},
                                             [n for n in good if n not in bisected.named], Policy(floor, 0.0),
                                             size=2))

    def _report(self, started: datetime, nodes: list[NodeInfo], missing: dict[str, str], instance_type: str,
                floors, found: Findings) -> dict:
        """The report's data: each node's verdict, the health checks and every test."""
        cfg, reasons, checks = self.cfg, found.reasons, found.checks
        names = [n.name for n in nodes] + list(missing)
        verdicts = {name: {"passed": not reasons[name], "reasons": reasons[name],
                           "transient": found.transient.get(name, []), **found.busbw.get(name, {})} for name in names}
        bad = sorted(name for name in names if reasons[name])
        health_json = {name: [c.to_json() for c in node_checks] for name, node_checks in checks.items()}
        shared = report.common_failures(health_json) if bad and len(bad) == len(names) else []
        if shared:
            self.notes.append(f"every node fails the same check ({'; '.join(shared)}): that is the configuration, "
                              f"not the nodes; fix it rather than excluding the whole cluster")
        return {
            "version": 1, "created": started.isoformat(timespec="seconds"),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "passed": bool(nodes) and not bad, "backend": cfg.backend, "accelerator": cfg.accelerator,
            "devices_per_node": cfg.devices, "instance_type": instance_type, "sizes": self.sizes,
            "judged": {"operation": cfg.sweep.operation, "size": self.judge_size,
                       "floors": {k: getattr(floors, k) for k in ("intra_node", "pair", "all_nodes", "at_bytes")}},
            "nodes": [{"rank": n.rank, "name": n.name, "address": n.address, **found.facts.get(n.name, {})}
                      for n in nodes],
            "health": health_json,
            "tests": self.tests, "verdicts": verdicts, "bad_nodes": bad, "notes": self.notes,
            "exclude_override": report.exclude_override([] if shared else bad, cfg.cluster_exclude),
        }

    def _finish(self, nodes: list[NodeInfo]) -> None:
        self.control.put(f"task/{self.seq}", {"kind": "exit"})
        deadline = time.monotonic() + 15
        for node in nodes:
            self._get(f"bye/{node.rank}", deadline)
