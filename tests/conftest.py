"""Fixtures shared by every test directory."""
import pytest

pytest_plugins = ["tests.slurm_cluster", "tests.s3_server", "tests.recipe_data"]


@pytest.fixture(autouse=True)
def _own_run_index(tmp_path_factory, monkeypatch):
    """Every launch records its run in the user's run index (launcher/run_index.py): a test's go to its own."""
    monkeypatch.setenv("NXDT_USER_CONFIG_DIR", str(tmp_path_factory.mktemp("nxdt-config")))


@pytest.fixture(autouse=True)
def _no_ambient_slurm(tmp_path_factory, monkeypatch):
    """cluster_type=auto submits wherever sbatch and a slurm.conf are found: on a head node (/etc/slurm answering)
    a test's launch would go to the real queue. A test sees no Slurm unless it asks for one: the local cluster's
    env (tests/slurm_cluster.py), or a fake (tests/fake_slurm.py)."""
    monkeypatch.setenv("SLURM_CONF", str(tmp_path_factory.getbasetemp() / "no-slurm-here.conf"))


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


# ---- A ceiling on any one test's time -----------------------------------------------------------------------

# A test (its setup, or its body) that runs longer than this fails, unless it is marked
# @pytest.mark.long("why it cannot be shorter or shared"): CI's budget is the whole suite in 20 minutes on 2 cores.
# The 60 s are for a test that has the machine's cores to itself. .ci/run runs more pytest streams than there are
# cores (xdist workers, the Slurm tests, the XLA tests: NXDT_TEST_STREAMS), so there a test gets a fair share of
# them and its allowance grows in proportion, never shrinks.
def _seconds_limit() -> float:
    import os

    streams = int(os.environ.get("NXDT_TEST_STREAMS") or 1)
    return 60.0 * max(1.0, streams / (os.cpu_count() or 1))


TEST_SECONDS_LIMIT = _seconds_limit()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when not in ("setup", "call") or report.outcome != "passed" or call.duration <= TEST_SECONDS_LIMIT:
        return
    marker = item.get_closest_marker("long")
    if marker is None or not (marker.args or marker.kwargs.get("reason")):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: its {call.when} took {call.duration:.0f} s, over the suite's "
                           f"{TEST_SECONDS_LIMIT:.0f} s per test (tests/conftest.py): share the run it waits on, "
                           f"make it smaller, or mark it @pytest.mark.long(\"why\")")


# ---- The Slurm stream's files --------------------------------------------------------------------------------

# .ci/run's Slurm stream collects only the files that mark Slurm tests (`grep -l mark.slurm`): collecting the
# whole suite costs each pytest process ~20 s of CPU, for 21 tests. A test marked another way would be deselected
# by the main stream and never collected by the Slurm one, so collection refuses it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    from pathlib import Path

    unmarked = sorted({str(item.path) for item in items if item.get_closest_marker("slurm") is not None
                       and "mark.slurm" not in Path(item.path).read_text()})
    if unmarked:
        raise pytest.UsageError(f"{', '.join(unmarked)}: Slurm tests must be marked with `pytest.mark.slurm` in "
                                f"their own file, where .ci/run's Slurm stream looks for them")
