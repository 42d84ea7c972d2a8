"""The pure sweep and bisection logic (csp_tools/cluster_validate/sweep.py) on synthetic measurements: a group
is as fast as its slowest member, a dead node makes every test it is in fail, and a bad node is tried in every
position of odd and even node counts."""

import itertools

import pytest

from csp_tools.cluster_validate.sweep import Measurement, Policy, bisect, judge, pair_sweep

FAST, SLOW = 10.0, 1.0


def nodes(n: int) -> list[str]:
    return [f"node{i}" for i in range(n)]


class Cluster:
    """Synthetic measurements: a node's speed in GB/s, or None for a node whose tests never complete."""

    def __init__(self, speeds: dict[str, float | None]):
        self.speeds = speeds
        self.rounds: list[list[tuple]] = []

    def measure(self, groups):
        members = [n for g in groups for n in g]
        assert len(members) == len(set(members)), f"groups of one round overlap: {groups}"
        assert all(len(g) >= 2 for g in groups), f"a collective needs two nodes: {groups}"
        self.rounds.append(groups)
        results = []
        for group in groups:
            speeds = [self.speeds[n] for n in group]
            if None in speeds:
                results.append(Measurement(group, None, "timed out"))
            else:
                results.append(Measurement(group, min(speeds)))
        return results


def cluster_with(n: int, bad: dict[int, float | None]) -> Cluster:
    return Cluster({name: bad.get(i, FAST) for i, name in enumerate(nodes(n))})


@pytest.mark.parametrize("n", range(3, 10))
def test_one_slow_node_is_named_in_every_position(n):
    for position in range(n):
        cluster = cluster_with(n, {position: SLOW})
        result = pair_sweep(nodes(n), cluster.measure, Policy())
        assert result.bad == [f"node{position}"], (n, position, result.verdicts)
        assert "known-good" in result.verdicts[f"node{position}"].reason
        assert len(result.rounds) <= 4, (n, position, cluster.rounds)


@pytest.mark.parametrize("n", [3, 4, 5, 7])
def test_a_dead_node_is_named_in_every_position(n):
    for position in range(n):
        cluster = cluster_with(n, {position: None})
        result = pair_sweep(nodes(n), cluster.measure, Policy())
        assert result.bad == [f"node{position}"], (n, position, result.verdicts)
        assert "no test completed" in result.verdicts[f"node{position}"].reason


@pytest.mark.parametrize("n", [5, 6, 7])
def test_two_slow_nodes_are_both_named_wherever_they_are(n):
    for a, b in itertools.combinations(range(n), 2):
        cluster = cluster_with(n, {a: SLOW, b: SLOW})
        result = pair_sweep(nodes(n), cluster.measure, Policy())
        assert sorted(result.bad) == [f"node{a}", f"node{b}"], (n, a, b, result.verdicts)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_a_healthy_cluster_passes_in_two_or_three_rounds(n):
    cluster = cluster_with(n, {})
    result = pair_sweep(nodes(n), cluster.measure, Policy())
    assert result.bad == []
    assert len(result.rounds) <= (1 if n == 2 else 3)
    # every node met two partners (one when there is only one other node)
    for node in nodes(n):
        met = {o for r in cluster.rounds for g in r if node in g for o in g if o != node}
        assert len(met) >= min(2, n - 1)


def test_round_one_pairs_side_by_side_and_the_odd_node_out_joins_the_best_node():
    cluster = Cluster({"a": 9.0, "b": 9.0, "c": 5.0, "d": 5.0, "e": 9.0})
    pair_sweep(list("abcde"), cluster.measure, Policy(outlier_fraction=0.0))
    assert cluster.rounds[0] == [("a", "b"), ("c", "d")]
    assert cluster.rounds[1][0] == ("e", "a"), "the odd node out is paired with a node of the fastest pair"


def test_two_nodes_cannot_tell_which_is_slow_without_a_floor_but_both_fail_one():
    cluster = cluster_with(2, {1: SLOW})
    assert pair_sweep(nodes(2), cluster.measure, Policy()).bad == []  # no peers: an outlier needs a reference
    result = pair_sweep(nodes(2), cluster_with(2, {1: SLOW}).measure, Policy(floor=5.0))
    assert result.bad == ["node0", "node1"]
    assert "no known-good node" in result.verdicts["node0"].reason


def test_absolute_floor_names_every_node_below_it():
    speeds = {"a": 3.0, "b": 3.0, "c": 3.0}
    result = pair_sweep(list("abc"), Cluster(speeds).measure, Policy(floor=4.0))
    assert sorted(result.bad) == ["a", "b", "c"]
    result = pair_sweep(list("abc"), Cluster(speeds).measure, Policy(floor=2.0))
    assert result.bad == []


def test_judge_compares_with_the_median_of_the_other_nodes():
    verdicts = judge({"a": 10.0, "b": 9.0, "c": 6.0, "d": None}, Policy(outlier_fraction=0.7))
    assert [n for n, v in verdicts.items() if not v.passed] == ["c", "d"]
    assert "median of its peers (9.5" in verdicts["c"].reason
    assert all(v.passed for v in judge({"a": 1.0, "b": 9.0}, Policy()).values()), "one peer is no reference"
    assert not judge({"a": 1.0, "b": 9.0}, Policy(min_peers=1))["a"].passed


def test_max_rounds_bounds_the_work():
    cluster = cluster_with(9, {0: None, 1: None, 2: None, 3: None})
    result = pair_sweep(nodes(9), cluster.measure, Policy(max_rounds=3))
    assert len(result.rounds) == 3


def test_single_node_passes_without_tests():
    cluster = Cluster({"a": 1.0})
    assert pair_sweep(["a"], cluster.measure, Policy()).bad == [] and cluster.rounds == []


def failing_with(bad: set[str], min_size: int = 1):
    """A group fails when it holds a bad node and has at least min_size nodes."""
    def measure(groups):
        members = [n for g in groups for n in g]
        assert len(members) == len(set(members)), groups
        return [Measurement(g, None, "wrong result") if (set(g) & bad and len(g) >= min_size)
                else Measurement(g, FAST) for g in groups]
    return measure


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8])
def test_bisection_names_the_bad_node_in_every_position(n):
    for position in range(n):
        bad = f"node{position}"
        result = bisect(tuple(nodes(n)), failing_with({bad}), lambda m: m.ok,
                        known_good=("spare",) if n == 2 else ())
        assert list(result.named) == [bad], (n, position, result)


def test_bisection_reports_a_failure_that_needs_the_whole_set():
    result = bisect(tuple(nodes(4)), failing_with({"node0"}, min_size=4), lambda m: m.ok)
    assert result.named == {}
    assert any("each half passed" in note for note in result.notes)


def test_bisection_without_any_known_good_node_says_so():
    result = bisect(("a", "b"), failing_with({"a", "b"}), lambda m: m.ok)
    assert result.named == {} and "not isolated" in result.notes[-1]
