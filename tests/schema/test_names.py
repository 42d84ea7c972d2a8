"""The run-name and Slurm-pattern rules (runtime/schema/rules.py) on their edges: the byte limit counts bytes, not
characters; '.' and '..' are not names; '%' is refused wherever sbatch would expand it."""

import pytest

from runtime.schema import rules


@pytest.mark.parametrize("name", ["gpt3_tiny", "a.b-c+d", "x" * rules.RUN_NAME_MAX_BYTES, "é" * 100, "..a", "a.."])
def test_names_that_are_one_directory_of_their_own(name):
    assert rules.run_name(name, "run_name") is None


@pytest.mark.parametrize("value,expected", [
    ("", "run_name: '' names no directory of its own"),
    (None, "run_name: '' names no directory of its own"),
    (".", "run_name: '.' names no directory of its own"),
    ("..", "run_name: '..' names no directory of its own"),
    ("a/b", "run_name: 'a/b' must be non-empty, without '/'"),
    ("a b", "run_name: 'a b' must be non-empty, without '/', spaces"),
    ("a\tb", "run_name: 'a\\tb' must be non-empty"),
    ("run%j", "run_name: 'run%j' contains '%', which sbatch expands in #SBATCH --output"),
    ("x" * 201, "run_name: the name is 201 bytes; use at most 200"),
    ("é" * 101, "run_name: the name is 202 bytes; use at most 200"),
    (1000.0, "run_name: 1000.0 is not text; quote a name made of digits, e.g. run_name='1000.0'"),
    (True, "run_name: True is not text"),
])
def test_names_that_are_refused(value, expected):
    problem = rules.run_name(value, "run_name")
    assert problem is not None and problem.startswith(expected), problem


def test_slurm_patterns():
    assert rules.slurm_pattern("/fsx/results", "base_results_dir") is None
    assert rules.slurm_pattern("/fsx/%u/results", "base_results_dir").startswith(
        "base_results_dir: '/fsx/%u/results' contains '%'")
