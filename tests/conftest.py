"""Fixtures shared by every test directory."""
import copy
import hashlib
import os
import sys

import pytest

pytest_plugins = ["tests.slurm_cluster", "tests.s3_server", "tests.recipe_data"]

# Nothing a test runs reaches for the Hugging Face Hub (this machine has no network: datasets and transformers
# would wait on retries), as the evaluation stage runs on a node (runtime/evaluate/lm_tasks.py offline). Set before
# any test imports them: both read it once, at import.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    """One per run: xdist's workers share it (their base temporaries are folders of the run's), as launches on one
    machine share the user's; what one composed, or lm-eval's task catalog (~20 s to build), the other reads."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "nxdt-launch-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("nxdt-launch-cache")


@pytest.fixture(autouse=True)
def _no_file_choices_left():
    """A test that maps a NeMo file itself (nxdt_config.map_file) leaves the choices it registered in Hydra's
    ConfigStore; a launch keeps them for its own compose (launcher/compose.py). Cleared after each test, so later
    tests in the process compose as a fresh launch does (plain_compose.registered_choices)."""
    yield
    hydra_store = sys.modules.get("hydra.core.config_store")
    if hydra_store is not None:
        from launcher.paths import CONFIG_GROUPS

        for group in CONFIG_GROUPS:
            hydra_store.ConfigStore.instance().repo.pop(group, None)


@pytest.fixture(scope="module", autouse=True)
def _no_world_left(request):
    """A module that joins a torch.distributed world in the test process leaves it before the next module runs:
    while one is joined, run_distributed (tests/runtime_parallel/dist_utils.py) spawns fresh interpreters rather
    than fork ranks that would inherit it, ~4 s of CPU per rank in every later test of the process."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.module.__name__} left a torch.distributed world joined; leave it where it was joined "
                    f"(runtime.device.shutdown, dist.destroy_process_group)", pytrace=False)


@pytest.fixture(autouse=True)
def _own_launch_cache(_launch_cache_dir, monkeypatch):
    """Launches reuse the configs earlier ones composed (launcher/cache.py): the tests' go to a cache of this
    run's own, never the user's (tests/launcher/test_launch_cache.py gives each of its tests a fresh one)."""
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
    # The files that hold a long test first, each whole and in its order (a file's module fixtures are set up once):
    # last in the collection, the README pipeline's 100 s ran at the end of one xdist worker while the other had
    # nothing left to take.
    holds_long = {item.path for item in items if item.get_closest_marker("long") is not None}
    items.sort(key=lambda item: item.path not in holds_long)


# Hydra reads, parses and wraps every file of a launch's defaults chain again for each compose (its
# CachingConfigRepository lasts one compose), and the in-process launches of the launcher and recipe tests compose
# hundreds of times. Within a test process a config file is parsed once per content (the key is a hash of its
# bytes, read each time, so a file a test rewrites is parsed again) and each compose gets a deep copy of what Hydra
# would have loaded (Hydra merges loaded nodes into its result in place). Every compose, rule and check runs as
# before. Hydra's ConfigStore is not memoized: a launch can add choices to it (training=@FILE).
_hydra_loaded: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def _hydra_parses_each_config_file_once(monkeypatch):
    try:
        from hydra._internal.config_repository import ConfigRepository
    except ImportError:  # another Hydra: compose as it does, only slower
        return
    load = ConfigRepository.load_config

    def load_config(self, config_path: str):
        key = _hydra_key(self, config_path)
        if key is None:
            return load(self, config_path)
        if key not in _hydra_loaded:
            _hydra_loaded[key] = load(self, config_path)  # a load that raises keeps nothing
        return copy.deepcopy(_hydra_loaded[key])

    monkeypatch.setattr(ConfigRepository, "load_config", load_config)


def _hydra_key(repo, config_path: str) -> tuple | None:
    """What loading `config_path` depends on: the source that holds it (the first that has it, as Hydra looks) and
    the file's bytes. None for any other source. By scheme, not class: Hydra's plugin scan loads its source modules
    a second time."""
    source = next((s for s in repo.get_sources() if s.is_config(config_path)), None)
    if source is None or source.scheme() not in ("file", "pkg"):
        return None
    if source.scheme() == "pkg":  # Hydra's own configs, in its installed package
        return "pkg", source.path, config_path
    name = config_path if config_path.endswith(".yaml") else f"{config_path}.yaml"
    with open(os.path.join(source.path, name), "rb") as f:
        digest = hashlib.blake2b(f.read(), digest_size=16).digest()
    return "file", source.path, config_path, digest
