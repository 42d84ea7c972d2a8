"""Shared by the recipe tests: where their dry-run launches write."""

import pytest


@pytest.fixture(scope="session")
def recipe_results_dir(tmp_path_factory):
    """The base_results_dir of every recipe launch here, one directory per recipe below it: test_recipes.py's
    launches and test_recipe_table.py's rows name the same one, so that the launch of a recipe on the target it is
    meant for has the same overrides in both, and launcher/cache.py's session cache (tests/conftest.py) composes it
    once for the two files."""
    return tmp_path_factory.mktemp("recipe_results")
