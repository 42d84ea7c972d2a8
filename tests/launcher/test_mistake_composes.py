"""A mistake costs one Hydra compose where composing the overrides without the launch's locations (the launch
cache's general compose, launcher/cache.py) provably names it as composing every override as typed does, and two
where it might not: each error is compared, line for line, with the compose of every override as typed
(cache.composed, what a launch without the cache runs)."""

from __future__ import annotations

import hydra
import pytest

from launcher import cache
from launcher.errors import UserError

TYPO = "training.model.tensor_model_paralel_size=2"


@pytest.fixture
def composes(monkeypatch, tmp_path):
    """The Hydra composes each call makes (compose.py imports hydra.compose when it composes)."""
    monkeypatch.setenv("NXDT_LAUNCH_CACHE", str(tmp_path / "cache"))
    count = [0]
    real = hydra.compose

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", counting)

    def run(call, overrides):
        count[0] = 0
        with pytest.raises(UserError) as raised:
            call(overrides)
        return str(raised.value), count[0]

    return run


@pytest.mark.parametrize("overrides, hydra_composes", [
    ([TYPO, "base_results_dir=/r", "run_name=x"], 1),                     # was 2
    (["base_results_dir=/r", "training=gpt3/tny"], 1),                     # was 2
    (["base_results_dir=/r", "stages=[training"], 1),                      # was 2
    (["base_results_dir=/r", "=5"], 0),                                    # before Hydra composes
    (["training.model.encoder_seq_length=${oops}", "training.run.name=a"], 1),   # found resolving: was 2
    # a resolver handed a location: named with the value typed, not the cache's placeholder
    (["training.model.encoder_seq_length='${oc.env:${training.run.name}}'", "training.run.name=nxdt_l2_unset"], 1),
    # Hydra sets overrides in typed order: a location before the mistake might fail first, so it is composed again
    (["base_results_dir=/r", TYPO], 2),
    # the location is the mistake (search_config is not composed): named as before
    (["search_config.run.name=x", TYPO], 2),
    (["training.run.name=a", "~training"], 2),
])
def test_a_mistake_is_named_as_typed_with_one_compose_where_that_is_the_same(composes, overrides, hydra_composes):
    expected, _ = composes(cache.composed, overrides)
    assert composes(cache.resolved, overrides) == (expected, hydra_composes)


def test_a_location_typed_after_the_mistake_is_still_named_when_it_is_the_only_one(composes):
    """The typo stops Hydra before it sets the location that would fail; alone, the location is named."""
    assert composes(cache.resolved, [TYPO, "search_config.run.name=x"])[0].startswith(
        "unknown key 'training.model.tensor_model_paralel_size'")
    message, _ = composes(cache.resolved, ["search_config.run.name=x"])
    assert message == composes(cache.composed, ["search_config.run.name=x"])[0]
    assert message.startswith("unknown key 'search_config'")
