"""Values that reach a shell are always quoted. Hostile values go into every template through overrides and
through the resolved config (newlines cannot be typed as a Hydra override); each script is then run, and
the canary file must never appear while every value arrives intact.

The Slurm scripts run under bash here with stand-ins for `srun` and `scontrol` (FAKES, named as such: the
real ones are exercised in test_slurm_integration.py); they only do what srun does to the command line."""

import copy
import os
import subprocess
from pathlib import Path

import pytest

from launcher.config import parse
from launcher.render import render
from launcher.stages import BUILDERS

from .helpers import resolved

PAYLOADS = [
    "$(touch CANARY)",
    "`touch CANARY`",
    "x; touch CANARY",
    "' ; touch CANARY ; '",
    '" ; touch CANARY ; "',
    "a\ntouch CANARY\nb",
    "$(touch${IFS}CANARY) && touch CANARY || touch CANARY",
]

FAKE_PYTHON = """#!/bin/bash
# Stand-in for the interpreter: records what the job script handed it.
printf '%s\\n' "$@" > "$RECORD_DIR/args.$NXDT_STAGE"
printf '%s' "$EVIL" > "$RECORD_DIR/evil.$NXDT_STAGE"
"""
FAKE_SRUN = """#!/bin/bash
# FAKE srun: drops srun's own options and runs the command on this machine as node 0.
while [[ "$1" == -* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
# FAKE scontrol: one node, at 127.0.0.1.
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=node1" ;;
esac
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """The stand-ins, the hostile interpreter and the config, composed once for the module's 98 scripts (a Hydra
    compose is most of each test's cost); each test gets a copy to make hostile and a working directory of its
    own, where a payload that ran would leave its CANARY."""
    root = tmp_path_factory.mktemp("hostile")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    # The interpreter's own path is hostile too.
    python_dir = root / "py $(touch CANARY) `touch CANARY`"
    python_dir.mkdir()
    python = _executable(python_dir / "python", FAKE_PYTHON)
    cfg = resolved(
        f"base_results_dir={root}/results",
        "run_name='r$(touch\\${IFS}CANARY)`touch\\${IFS}CANARY`;x'",
        f"python='{python}'",
        stable=False,
    )
    return root, bin_dir, cfg


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
@pytest.mark.parametrize("stage", sorted(BUILDERS))
@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_hostile_values_stay_data(composed, tmp_path, payload, stage, executor):
    root, bin_dir, composed_cfg = composed
    work = tmp_path / "work"
    work.mkdir()
    single_line = payload.replace("\n", " ")
    cfg = copy.deepcopy(composed_cfg)
    cfg["env_vars"] = {"EVIL": payload, "OTHER": single_line}
    cfg["cluster"]["env_vars"] = {"CLUSTER_EVIL": payload}
    cfg["cluster"]["srun_args"] = [f"--comment={single_line}"]
    cfg["training"]["model"]["tokenizer"]["model"] = payload
    job = BUILDERS[stage](parse(cfg))
    script = render(job, cfg, executor=executor, produced_by=f"nxdt-launch {payload}")
    path = tmp_path / f"{stage}.{executor}.sh"
    path.write_text(script)

    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_DIR": str(tmp_path),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1"}
    if job.array_size:
        env["SLURM_ARRAY_TASK_ID"] = "0"
    result = subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, text=True, timeout=60)

    assert not list(tmp_path.rglob("CANARY")) + list(root.rglob("CANARY")), f"payload executed:\n{script}"
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / f"evil.{stage}").read_text() == payload
    args = (tmp_path / f"args.{stage}").read_text().splitlines()
    assert str(job.config_path) in args
