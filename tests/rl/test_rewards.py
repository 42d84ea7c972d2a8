"""runtime/rl/rewards.py: the verifiable rewards, and one error line for a reward that cannot be loaded or fails."""
from __future__ import annotations

import pytest

from runtime.rl.rewards import exact_match, last_number, load_reward, regex_match, score


def test_rewards():
    assert exact_match("  42\n", "42") == 1.0 and exact_match("42.", "42") == 0.0
    assert regex_match(" four ", "4|four") == 1.0 and regex_match("fourteen", "4|four") == 0.0
    assert last_number("so 3 + 4 = 1,234.", "1234") == 1.0 and last_number("no number", "5") == 0.0
    assert last_number("7", "not a number") == 0.0


def test_load_reward_by_dotted_path():
    assert load_reward("runtime.rl.rewards:exact_match") is exact_match
    assert load_reward("runtime.rl.rewards.regex_match") is regex_match


@pytest.mark.parametrize("path, says", [
    ("no_such_module_xyz:reward", "cannot import no_such_module_xyz (ModuleNotFoundError"),
    ("runtime.rl.rewards:nothing", "runtime.rl.rewards has no function 'nothing'"),
    ("runtime.rl.rewards:_NUMBER", "has no function '_NUMBER'"),
    ("exact_match", "names no function"),
    ("", "is not a dotted path"),
])
def test_a_bad_path_is_one_line_naming_it(path, says):
    with pytest.raises(ValueError) as error:
        load_reward(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"reward: {path!r}") and says in message


def test_a_failing_reward_is_one_line_naming_it_and_the_prompt():
    def broken(completion, answer):
        raise RuntimeError("multi\nline")

    with pytest.raises(ValueError) as error:
        score(broken, ["a", "b", "c"], ["x", "y", "z"], [7, 7, 9], name="my.rewards:broken")
    assert str(error.value) == "reward my.rewards:broken failed on prompt 7: RuntimeError: multi line"
    with pytest.raises(ValueError) as error:
        score(regex_match, ["a"], ["("], [4])
    assert "\n" not in str(error.value) and "runtime.rl.rewards:regex_match failed on prompt 4" in str(error.value)
    with pytest.raises(ValueError) as error:
        score(lambda c, a: None, ["a"], ["x"], [2], name="none")
    assert str(error.value) == "reward none returned None on prompt 2; a reward is a finite number"
    assert score(lambda c, a: c == a, ["a", "b"], ["a", "a"], [0, 0]) == [1.0, 0.0]
