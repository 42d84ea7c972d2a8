"""The launch cache (launcher/cache.py): a launch served from it writes byte for byte what a fresh compose writes,
without importing Hydra; whatever the config reads (a conf file, an override, an environment variable, the working
directory) changes the result as before; a damaged entry is recomposed; a mistake is reported the same way every
time and nothing of it is stored. Each test runs the real CLI in fresh processes with a cache of its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import REPO

# Runs the CLI, then says on stderr's last line whether Hydra and OmegaConf were imported, and whether the launch
# composed (with Hydra, launcher/compose.py, or without, launcher/plain_resolve.py) rather than read the cache.
PROBE = (
    "import sys\n"
    "from launcher.cli import run\n"
    "code = run(sys.argv[1:])\n"
    "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf'})\n"
    "loaded += ['composed'] if {'launcher.compose', 'launcher.plain_resolve'} & set(sys.modules) else []\n"
    "print('imported:', ','.join(loaded) or '-', file=sys.stderr)\n"
    "sys.exit(code)\n"
)
DAY_NS = 86_400 * 10**9


class Launches:
    """Dry runs into one results directory, emptied before each, with this test's cache."""

    def __init__(self, tmp_path: Path):
        self.results = tmp_path / "results"
        self.cache = tmp_path / "cache"
        self.cwd = tmp_path
        self.env = {"NXDT_LAUNCH_CACHE": str(self.cache)}

    def __call__(self, *overrides: str, env: dict | None = None, cwd: Path | None = None,
                 results: bool = True) -> dict:
        shutil.rmtree(self.results, ignore_errors=True)
        args = [*overrides, "--dry-run", *([f"base_results_dir={self.results}"] if results else [])]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        result = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd or self.cwd, capture_output=True,
                                text=True, timeout=600,
                                env={**os.environ, "PYTHONPATH": path, **self.env, **(env or {})})
        *errors, imported = result.stderr.splitlines()
        assert imported.startswith("imported: "), result.stderr
        return {
            "code": result.returncode,
            "stdout": result.stdout,
            "stderr": errors,
            "hydra": "hydra" in imported,
            "omegaconf": "omegaconf" in imported,
            "composed": "composed" in imported,
            "files": _files(self.results),
        }

    def entries(self) -> list[Path]:
        return sorted((self.cache / "compose").glob("*.json"))


LAUNCH_ID = re.compile(rb"launches/\d{8}T\d{6}Z-[0-9a-f]{4}")  # launch.new_launch_id: one per launch, by design


def _files(root: Path) -> dict[str, bytes]:
    return {LAUNCH_ID.sub(b"launches/ID", str(p.relative_to(root)).encode()).decode():
            LAUNCH_ID.sub(b"launches/ID", p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def launch(tmp_path) -> Launches:
    return Launches(tmp_path)


@pytest.mark.parametrize("overrides", [
    ["stages=[training]", "training=gpt3/175b", "cluster_type=slurm"],
    # The cluster switches the recipe (launcher/targets.py): two composes when not cached.
    ["stages=[training]", "training=gpt3/175b", "cluster=pcluster_trn1", "cluster_type=slurm"],
    ["stages=[training,conversion,evaluation]", "training=llama3/8b", "cluster=pcluster_trn2", "cluster_type=slurm",
     "training.trainer.max_steps=2000", "env_vars.NCCL_DEBUG=INFO"],
    ["stages=[fine_tuning]", "fine_tuning=llama3/8b", "cluster_type=slurm"],
    ["stages=[training]", "training=gpt3/tiny", "cluster_type=local"],
], ids=["175b", "175b-trn1", "llama3-8b-trn2", "fine-tuning", "tiny-local"])
def test_a_hit_writes_byte_for_byte_what_a_fresh_compose_writes_without_importing_hydra(launch, overrides):
    fresh = launch(*overrides, env={"NXDT_LAUNCH_CACHE": "off", "NXDT_LAUNCH_COMPOSE": "hydra"})
    assert fresh["code"] == 0, fresh["stderr"]
    assert fresh["hydra"] and fresh["files"] and not launch.cache.exists()

    cold = launch(*overrides)  # composed without Hydra or OmegaConf (launcher/plain_compose.py)
    assert cold["composed"] and not cold["hydra"] and not cold["omegaconf"] and len(launch.entries()) == 1
    hit = launch(*overrides)
    assert not hit["composed"] and not hit["hydra"] and not hit["omegaconf"]
    for result in (cold, hit):
        assert (result["code"], result["stdout"], result["stderr"]) == (0, fresh["stdout"], fresh["stderr"])
        assert result["files"] == fresh["files"]


@pytest.mark.parametrize("names", [
    [],
    ["training.run.name=other"],
    ["run_name=top", "conversion.run.name=conv"],
], ids=["recipe-name", "training-name", "run-and-conversion-name"])
def test_a_launch_into_another_results_dir_and_run_name_is_a_hit_that_writes_what_a_fresh_compose_writes(
        launch, tmp_path, names):
    """The entry holds the locations as placeholders (launcher/cache.py): every path, name and interpolation that
    reads them, the user's own too, comes out as a compose of this launch's overrides gives it."""
    base = ["stages=[training,conversion,evaluation]", "training=gpt3/175b", "cluster_type=slurm",
            "env_vars.WHERE=${base_results_dir}/${run_name}:${training.run.name}:${conversion.run.name}"]
    launch.results = tmp_path / "first"
    assert launch(*base, "training.run.name=seed", "run_name=seed_run")["code"] == 0
    launch.results = tmp_path / "second"
    fresh = launch(*base, *names, env={"NXDT_LAUNCH_CACHE": "off", "NXDT_LAUNCH_COMPOSE": "hydra"})
    assert fresh["code"] == 0 and fresh["files"], fresh["stderr"]
    hit = launch(*base, *names)
    assert not hit["composed"] and len(launch.entries()) == 1
    assert (hit["code"], hit["stdout"], hit["stderr"], hit["files"]) == (0, fresh["stdout"], fresh["stderr"],
                                                                        fresh["files"])
    assert str(launch.results) in hit["stdout"]


def test_a_location_a_resolver_reads_is_keyed_as_typed(launch, tmp_path):
    """${oc.env:NAME,DEFAULT} is handed the run name to build a variable's name, not given it as text: a placeholder
    in its place would read another variable. Each launch composes and comes out as a fresh compose does."""
    base = ["stages=[training]", "training=gpt3/tiny", "cluster_type=slurm",
            "env_vars.FOUND='${oc.env:NXDT_TEST_${training.run.name},unset}'"]
    env = {"NXDT_TEST_second": "found"}
    for name in ("first", "second"):
        launch.results = tmp_path / name
        fresh = launch(*base, f"training.run.name={name}", env={**env, "NXDT_LAUNCH_CACHE": "off"})
        cached = launch(*base, f"training.run.name={name}", env=env)
        assert cached["composed"] and fresh["code"] == 0 and cached["files"] == fresh["files"]
        found = "found" if name == "second" else "unset"
        assert f"export FOUND={found}\n".encode() in cached["files"][f"{name}/training/training.sbatch"]
    assert not launch(*base, "training.run.name=second", env=env)["composed"]  # keyed on the name, as typed


def test_a_location_set_again_by_another_override_is_keyed_as_typed(launch):
    """Hydra applies overrides in order: `training.run={name:second}` names the run again after
    `training.run.name=first`, so the name cannot be filled in after composing."""
    overrides = ["stages=[training]", "training=gpt3/tiny", "cluster_type=slurm", "training.run.name=first",
                 "training.run={name:second}"]
    fresh = launch(*overrides, env={"NXDT_LAUNCH_CACHE": "off"})
    cached = launch(*overrides)
    assert fresh["code"] == 0 and "second/training/training.sbatch" in fresh["files"]
    assert (cached["code"], cached["files"]) == (0, fresh["files"])


def _conf_copy(tmp_path: Path) -> Path:
    """conf/ with every file dated a day back: none of them counts as just changed."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    for path in conf.rglob("*"):
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - DAY_NS))
    return conf


def test_a_changed_conf_file_or_override_composes_again(launch, tmp_path):
    launch.env["NXDT_CONF_DIR"] = str(_conf_copy(tmp_path))
    recipe = tmp_path / "conf/training/gpt3/tiny.yaml"
    base = ["stages=[training]", "training=gpt3/tiny", "cluster_type=slurm"]
    assert launch(*base)["composed"] and not launch(*base)["composed"]

    # Same size, one second newer: only the mtime tells.
    text = recipe.read_text()
    assert "max_steps: 150\n" in text
    stat = recipe.stat()
    recipe.write_text(text.replace("max_steps: 150\n", "max_steps: 250\n"))
    os.utime(recipe, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = launch(*base)
    assert changed["composed"] and changed["code"] == 0, changed["stderr"]
    assert b"max_steps: 250\n" in changed["files"]["gpt3_tiny/training/training_config.yaml"]
    assert not launch(*base)["composed"]

    other = launch(*base, "training.trainer.max_steps=300")
    assert other["composed"] and b"max_steps: 300\n" in other["files"]["gpt3_tiny/training/training_config.yaml"]
    again = launch(*base)
    assert not again["composed"] and b"max_steps: 250\n" in again["files"]["gpt3_tiny/training/training_config.yaml"]


def test_a_file_changed_in_the_last_seconds_is_not_stored(launch, tmp_path):
    """Its mtime may not move on a second change within the file system's timestamp granularity."""
    launch.env["NXDT_CONF_DIR"] = str(conf := _conf_copy(tmp_path))
    # Stamped a minute ahead rather than touched: under load the launch may start more than launcher/cache.py's
    # RACY_NS after a touch, and would rightly store the entry.
    ahead = time.time_ns() + 60 * 10**9
    os.utime(conf / "cluster/slurm.yaml", ns=(ahead, ahead))
    assert launch("stages=[training]", "cluster_type=slurm")["code"] == 0
    assert launch.entries() == []


def test_a_damaged_entry_is_recomposed_and_replaced(launch):
    base = ["stages=[training]", "training=gpt3/175b", "cluster_type=slurm"]
    fresh = launch(*base)
    [entry] = launch.entries()
    good = entry.read_bytes()
    header, body = good.split(b"\n", 1)
    damaged = [
        b"",
        good[: len(good) // 2],
        header + b"\n" + body.replace(b'"num_nodes":128', b'"num_nodes":127'),  # valid JSON, wrong checksum
        b"\x00\xff" * 100,
    ]
    for data in damaged:
        entry.write_bytes(data)
        result = launch(*base)
        assert result["composed"] and (result["code"], result["files"]) == (0, fresh["files"])
        assert entry.read_bytes() == good
    # Jinja's compiled templates too.
    for compiled in (launch.cache / "templates").iterdir():
        compiled.write_bytes(compiled.read_bytes()[:40])
    assert launch(*base)["files"] == fresh["files"]


@pytest.mark.parametrize("overrides, message, composes", [
    (["training.model.tensor_model_paralel_size=2"], "unknown key 'training.model.tensor_model_paralel_size'", False),
    (["training=gpt3/tny"], "training=gpt3/tny: no such choice; did you mean 'gpt3/tiny'?", False),
    (["stages=[training"], "override 'stages=[training' is not valid Hydra syntax", False),
    (["training.trainer.max_steps=${oc.env:NXDT_TEST_UNSET_VARIABLE}"], "NXDT_TEST_UNSET_VARIABLE", False),
    # Composes, and the rules refuse it: from the cache the second time, the same way.
    (["training.model.num_layers=1", "training.model.pipeline_model_parallel_size=2"],
     "training.model.num_layers: 1 is fewer than the pipeline stages", True),
])
def test_a_mistake_is_one_line_every_time_and_writes_nothing(launch, overrides, message, composes):
    first, second = launch("stages=[training]", *overrides), launch("stages=[training]", *overrides)
    for result in (first, second):
        assert result["code"] == 2 and result["files"] == {}
        assert len(result["stderr"]) == 1 and message in result["stderr"][0], result["stderr"]
    assert first["stderr"] == second["stderr"]
    assert len(launch.entries()) == composes and second["hydra"] != composes


def test_an_environment_variable_the_config_reads_is_checked_on_every_hit(launch):
    base = ["stages=[training]", "training=gpt3/tiny", "cluster_type=slurm",
            "env_vars.FROM_ENV=${oc.env:NXDT_TEST_VALUE}"]
    script = "gpt3_tiny/training/training.sbatch"
    first = launch(*base, env={"NXDT_TEST_VALUE": "first"})
    assert b"export FROM_ENV=first\n" in first["files"][script]
    assert not launch(*base, env={"NXDT_TEST_VALUE": "first"})["composed"]
    second = launch(*base, env={"NXDT_TEST_VALUE": "second"})
    assert second["composed"] and b"export FROM_ENV=second\n" in second["files"][script]
    unset = launch(*base)
    assert unset["code"] == 2 and "NXDT_TEST_VALUE" in unset["stderr"][0]


def test_the_working_directory_is_part_of_the_key(launch, tmp_path):
    """base_results_dir defaults to ${cwd:}/results."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        result = launch("stages=[training]", "cluster_type=slurm", cwd=tmp_path / name, results=False)
        assert result["code"] == 0 and result["composed"], result["stderr"]
        assert (tmp_path / name / "results/gpt3_tiny/training/training.sbatch").is_file()
    assert not launch("stages=[training]", "cluster_type=slurm", cwd=tmp_path / "a", results=False)["composed"]


def test_a_resolver_the_key_cannot_fix_is_never_cached(launch):
    """Hydra's ${now:...} reads the clock."""
    base = ["stages=[training]", "cluster_type=slurm", "env_vars.STARTED=${now:%H%M%S%f}"]
    assert launch(*base)["code"] == 0 and launch(*base)["composed"]
    assert launch.entries() == []


def test_off_composes_every_time_and_writes_no_cache(launch, tmp_path):
    home = tmp_path / "home"
    env = {"NXDT_LAUNCH_CACHE": "off", "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    for _ in range(2):
        assert launch("stages=[training]", "cluster_type=slurm", env=env)["composed"]
    assert not home.exists() and not launch.cache.exists()


def test_the_default_cache_is_under_xdg_cache_home(launch, tmp_path):
    env = {"NXDT_LAUNCH_CACHE": "", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    launch("stages=[training]", "cluster_type=slurm", env=env)
    assert not launch("stages=[training]", "cluster_type=slurm", env=env)["composed"]
    assert list((tmp_path / "xdg/nxdt-launch/compose").glob("*.json"))
