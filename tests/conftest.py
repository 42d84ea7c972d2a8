"""Fixtures shared by every test directory."""
import pytest

pytest_plugins = ["tests.slurm_cluster", "tests.s3_server", "tests.recipe_data"]


@pytest.fixture(autouse=True)
def _own_run_index(tmp_path_factory, monkeypatch):
    """Every launch records its run in the user's run index (launcher/run_index.py): a test's go to its own."""
    monkeypatch.setenv("NXDT_USER_CONFIG_DIR", str(tmp_path_factory.mktemp("nxdt-config")))


@pytest.fixture(scope="session")
def _launch_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nxdt-launch-cache")


@pytest.fixture(autouse=True)
def _own_launch_cache(_launch_cache_dir, monkeypatch):
    """Launches reuse the configs earlier ones composed (launcher/cache.py): the tests' go to a cache of this
    session's own, never the user's (tests/launcher/test_launch_cache.py gives each of its tests a fresh one)."""
    monkeypatch.setenv("NXDT_LAUNCH_CACHE", str(_launch_cache_dir))


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning OpenMP threads slow
    every step (and decoding's many small matmuls) down many times over: a test module asks for one thread."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
