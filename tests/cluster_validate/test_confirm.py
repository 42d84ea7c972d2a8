"""The rule that names a node only when its deficit repeats (csp_tools/cluster_validate/confirm.py), on synthetic
measurements: a suspect whose second measurement is good is reported as transient and not named, one whose deficit
repeats is named; a collective suspect is measured again with a healthy partner beside a healthy reference, so a
machine that is busy for a moment names nobody. The self-healing node check uses the same rule."""

import json
from types import SimpleNamespace

import pytest

from csp_tools.cluster_validate.confirm import REMEASURES, Remeasured, confirm, remeasure_groups
from csp_tools.cluster_validate.sweep import Measurement, Policy, pair_sweep
from runtime.fault_tolerance import attempts
from runtime.fault_tolerance.node_check import confirmed

FAST, SLOW = 10.0, 1.0


def test_a_suspect_whose_second_measurement_is_good_is_not_named():
    asked = []

    def remeasure(keys):
        asked.append(keys)
        return {k: Remeasured(k == "node2", f"{k} measured again") for k in keys}

    found = confirm({"node1": "busbw 1 GB/s", "node2": "busbw 2 GB/s"}, remeasure)
    assert asked == [["node1", "node2"]] and REMEASURES == 1
    assert list(found.named) == ["node2"] and list(found.transient) == ["node1"]
    assert found.named["node2"] == "busbw 2 GB/s; repeated when measured again (node2 measured again)"
    assert found.transient["node1"] == \
        "busbw 1 GB/s; transient: not repeated when measured again (node1 measured again)"


def test_every_remeasure_must_repeat_the_deficit_and_a_good_one_ends_the_suspicion():
    answers = {"a": [True, True], "b": [True, False], "c": [False]}
    asked = []

    def remeasure(keys):
        asked.append(list(keys))
        return {k: Remeasured(answers[k].pop(0), "again") for k in keys}

    found = confirm({k: "first" for k in answers}, remeasure, remeasures=2)
    assert asked == [["a", "b", "c"], ["a", "b"]], "a transient suspect is not measured again"
    assert list(found.named) == ["a"] and sorted(found.transient) == ["b", "c"]
    assert confirm({"a": "first"}, remeasure, remeasures=0).named == {"a": "first"}
    assert confirm({}, lambda keys: pytest.fail("nothing to measure")).named == {}


class Machine:
    """Pairs on one machine: a group is as fast as its slowest node, times the machine's load in that round
    (`busy`: the 1-based rounds in which everything runs at a quarter of its speed)."""

    def __init__(self, speeds, busy=()):
        self.speeds, self.busy, self.rounds = speeds, set(busy), []

    def measure(self, groups):
        members = [n for g in groups for n in g]
        assert len(members) == len(set(members)), f"groups of one round overlap: {groups}"
        self.rounds.append(list(groups))
        load = 0.25 if len(self.rounds) in self.busy else 1.0
        return [Measurement(g, min(self.speeds[n] for n in g) * load) for g in groups]


def sweep_then_confirm(machine, nodes, policy=Policy()):
    swept = pair_sweep(nodes, machine.measure, policy)
    suspects = {n: v.reason for n, v in swept.verdicts.items() if not v.passed}
    healthy = [n for n in nodes if swept.verdicts[n].passed]
    return suspects, confirm(suspects, lambda s: remeasure_groups(s, healthy, machine.measure, policy, size=2))


def test_a_node_slow_only_while_the_machine_was_busy_is_transient():
    # The loaded 3-node localhost: node3's two pairs ran while the machine was busy, node1-node2 while it was not.
    machine = Machine({"node1": FAST, "node2": FAST, "node3": FAST}, busy={2, 3})
    suspects, found = sweep_then_confirm(machine, ["node1", "node2", "node3"])
    assert list(suspects) == ["node3"], "the first measurement marks node3"
    assert found.named == {} and "transient" in found.transient["node3"]
    assert "node3,node1: busbw 10 GB/s, 1.00 x the 10 GB/s of the healthy group node1,node2" in found.transient["node3"]
    # measured again with a healthy partner, beside a healthy reference (the rounds before and after: they share node1)
    assert machine.rounds[3:] == [[("node1", "node2")], [("node3", "node1")], [("node1", "node2")]]


def test_a_load_that_starts_during_the_remeasure_is_judged_against_the_lower_reference_around_it():
    # quiet for the reference before, busy from the suspect's round on: the reference after is as busy as it
    machine = Machine({"node1": FAST, "node2": FAST, "node3": FAST}, busy={2, 3, 5, 6})
    suspects, found = sweep_then_confirm(machine, ["node1", "node2", "node3"])
    assert list(suspects) == ["node3"] and found.named == {}
    assert "1.00 x the 2.5 GB/s of the healthy group node1,node2" in found.transient["node3"]


def test_a_machine_busy_during_the_remeasure_names_nobody_because_the_reference_is_busy_too():
    machine = Machine({"node1": FAST, "node2": FAST, "node3": FAST}, busy={2, 3, 4, 5})
    suspects, found = sweep_then_confirm(machine, ["node1", "node2", "node3"])
    assert list(suspects) == ["node3"] and found.named == {} and list(found.transient) == ["node3"]


@pytest.mark.parametrize("busy", [(), (4, 5), (2, 3, 4, 5)])
def test_a_slow_node_is_named_however_busy_the_machine(busy):
    machine = Machine({"node1": FAST, "node2": FAST, "node3": SLOW}, busy=busy)
    suspects, found = sweep_then_confirm(machine, ["node1", "node2", "node3"])
    assert list(found.named) == ["node3"] and found.transient == {}
    assert "known-good" in found.named["node3"] and "below 0.7 x" in found.named["node3"]


def test_with_enough_healthy_nodes_the_reference_runs_in_the_same_round():
    machine = Machine({f"n{i}": FAST for i in range(6)} | {"n2": SLOW, "n4": SLOW})
    found = remeasure_groups(["n2", "n4"], ["n0", "n1", "n3", "n5"], machine.measure, Policy(), size=2)
    assert machine.rounds == [[("n2", "n0"), ("n4", "n1"), ("n3", "n5")]]
    # more suspects than healthy partners: rounds of suspects, the references between them shared
    five = Machine({"a": SLOW, "b": FAST, "c": SLOW, "d": FAST, "e": FAST})
    judged = remeasure_groups(["a", "b", "c"], ["d", "e"], five.measure, Policy(), size=2)
    assert five.rounds == [[("d", "e")], [("a", "d"), ("b", "e")], [("d", "e")], [("c", "d")], [("d", "e")]]
    assert sorted(n for n, r in judged.items() if r.deficit) == ["a", "c"]
    assert found["n2"].deficit and found["n4"].deficit and "n3,n5" in found["n2"].detail
    # judged by the floor alone (the bisection's rule), no reference is measured
    alone = Machine({"a": SLOW, "b": FAST, "c": FAST})
    floor_only = Policy(floor=5.0, outlier_fraction=0.0)
    assert remeasure_groups(["a"], ["b", "c"], alone.measure, floor_only, size=2)["a"].deficit
    assert alone.rounds == [[("a", "b")]]


def test_intra_node_suspects_are_measured_alone_beside_a_healthy_node_alone():
    seen = []

    def measure(groups):
        seen.append(list(groups))
        return [Measurement(g, {"a": 8.0, "b": 2.0, "c": 9.0}[g[0]]) for g in groups]

    found = remeasure_groups(["a", "b"], ["c"], measure, Policy(), size=1)
    assert seen == [[("a",), ("b",), ("c",)]]
    assert not found["a"].deficit and found["b"].deficit


def test_without_a_healthy_node_the_suspects_are_measured_together_against_the_floor():
    # Two nodes, both below the floor (they cannot be told apart): the pair is measured again, against the floor.
    machine = Machine({"a": 3.0, "b": FAST})
    found = confirm({"a": "first", "b": "first"},
                    lambda s: remeasure_groups(s, [], machine.measure, Policy(floor=5.0), size=2))
    assert machine.rounds == [[("a", "b")]] and sorted(found.named) == ["a", "b"]
    # a dead node stays dead; the baseline stands in for a reference when none can be measured
    dead = remeasure_groups(["a"], [], lambda gs: [Measurement(g, None, "timed out") for g in gs], Policy(), size=1)
    assert dead["a"].deficit and "timed out" in dead["a"].detail
    slow = remeasure_groups(["a"], [], Machine({"a": SLOW}).measure, Policy(), size=1, baseline=FAST)
    assert slow["a"].deficit and "the healthy nodes' earlier median" in slow["a"].detail


def test_the_node_check_names_a_node_only_when_a_failed_check_fails_again():
    def runs(*statuses):
        answers = [[{"name": "memory", "status": s, "detail": f"{s} memory"}, {"name": "efa", "status": "n/a",
                                                                                "detail": "absent"}]
                   for s in statuses]
        return lambda: answers.pop(0)

    pauses = []
    once = confirmed(runs("fail", "pass"), lambda: pauses.append(1))
    assert once["ok"] and once["named"] == {} and pauses == [1]
    assert once["transient"] == {"memory": "memory: fail memory; transient: not repeated when measured again "
                                           "(pass: pass memory)"}
    twice = confirmed(runs("fail", "fail"), lambda: None)
    assert not twice["ok"] and twice["named"]["memory"] == \
        "memory: fail memory; repeated when measured again (failed the same way)"
    answers = [[{"name": "memory", "status": "fail", "detail": "x"}], []]
    gone = confirmed(lambda: answers.pop(0), lambda: None)
    assert gone["named"]["memory"] == "memory: x; repeated when measured again (the check did not run)"
    assert confirmed(runs("pass"), lambda: pytest.fail("no pause without a failure"))["ok"]


def test_the_job_restarts_after_a_transient_node_check_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for node, transient in (("node1", {}), ("node2", {"memory": "memory: 0.2 GiB; transient: ..."})):
        (tmp_path / f"check_{node}.json").write_text(json.dumps(
            {"node": node, "ok": True, "checks": [], "named": {}, "transient": transient}))
    args = SimpleNamespace(attempt_dir=str(tmp_path), history=str(tmp_path / "history.jsonl"), stage="training",
                           job="7_0", attempt=0, in_job_restarts=3, requeues_on_failure=2, min_nodes=2,
                           allocation="node1 node2", excluded="", usable="node1 node2 node3")
    assert attempts.checked(args) == "restart"
    assert "transient, not named: node2 (memory: 0.2 GiB" in capsys.readouterr().err
    record = json.loads((tmp_path / "history.jsonl").read_text().splitlines()[-1])
    assert record["bad_nodes"] == {} and list(record["transient"]) == ["node2"]


def test_the_docs_state_the_noise_tolerated_with_the_codes_figures():
    import yaml

    from csp_tools.cluster_validate.confirm import HEALTH_RECHECK_PAUSE_S
    from tests.launcher.helpers import REPO

    doc = (REPO / "docs/cluster_validation.md").read_text()
    fraction = yaml.safe_load((REPO / "conf/cluster_validation/default.yaml").read_text())["sweep"]["outlier_fraction"]
    for figure in (f"`REMEASURES = {REMEASURES}`", f"{HEALTH_RECHECK_PAUSE_S:g} s later (`HEALTH_RECHECK_PAUSE_S`)",
                   f"`sweep.outlier_fraction: {fraction:g}`", f"`outlier_fraction` ({fraction:g})",
                   f"down to {fraction * 100:.0f}% of its peers' median"):
        assert figure in doc, figure
    assert f"runs again {HEALTH_RECHECK_PAUSE_S:g} s later" in (REPO / "docs/fault_tolerance.md").read_text()


def test_the_report_says_a_transient_deficit_under_the_node_that_passed():
    from csp_tools.cluster_validate import report

    text = report.verdict_text({"verdicts": {"node3": {"passed": True, "reasons": [],
                                                       "transient": ["pairs: slow; transient: not repeated"]}},
                                "exclude_override": "cluster.exclude=[]"})
    assert text.splitlines()[:2] == ["PASS node3", "  node3: pairs: slow; transient: not repeated"]


def test_the_node_check_on_this_machine_names_an_injected_fault_once_it_repeats(tmp_path, monkeypatch, capsys):
    from csp_tools.cluster_validate import confirm as confirm_module
    from runtime.fault_tolerance import node_check
    from runtime.schema import faults

    monkeypatch.setattr(confirm_module, "HEALTH_RECHECK_PAUSE_S", 0.0)
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    argv = ["--out", str(tmp_path), "--results-dir", str(tmp_path)]
    monkeypatch.delenv(faults.ENV, raising=False)
    assert node_check.main(argv) == 0  # this machine's real checks pass (results dir writable, memory available)
    assert json.loads((tmp_path / "check_node2.json").read_text())["named"] == {}
    monkeypatch.setenv(faults.ENV, "unhealthy:node=node2")
    assert node_check.main(argv) == 1  # the injected fault holds for the allocation: it fails again, and is named
    report = json.loads((tmp_path / "check_node2.json").read_text())
    assert not report["ok"] and report["named"]["injected"].startswith("injected: injected fault")
    assert report["named"]["injected"].endswith("; repeated when measured again (failed the same way)")
    assert "node check on node2: FAIL: injected: injected fault" in capsys.readouterr().out
