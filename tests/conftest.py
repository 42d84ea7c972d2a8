"""Fixtures shared by every test directory."""
import pytest

pytest_plugins = ["tests.slurm_cluster", "tests.s3_server", "tests.recipe_data"]


@pytest.fixture(autouse=True)
def _own_run_index(tmp_path_factory, monkeypatch):
    """Every launch records its run in the user's run index (launcher/run_index.py): a test's go to its own."""
    monkeypatch.setenv("NXDT_USER_CONFIG_DIR", str(tmp_path_factory.mktemp("nxdt-config")))
