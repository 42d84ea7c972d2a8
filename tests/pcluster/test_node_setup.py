"""What a ParallelCluster node gets, without aws-parallelcluster: the node script installs the Neuron system
software as AWS's Neuron setup guide does, and the job scripts run the venv that script makes, whichever
interpreter ran nxdt-launch."""

import os
import subprocess
import sys

import pytest

from launcher import pcluster
from launcher.config import parse_cluster
from launcher.launch import build
from launcher.render import python, render
from launcher.validate import cluster as cluster_problems
from tests.launcher.helpers import REPO, resolved

GOLDEN = REPO / "tests" / "golden" / "pcluster_on_node_configured.trn1.sh"
REQUIRED = ["subnet_id=subnet-0123456789abcdef0", "node_setup.script_s3_uri=s3://my-bucket/nxdt/on_node_configured.sh"]
# AWS's Neuron setup (Ubuntu): the Neuron apt repository, signed by its key; kernel headers for DKMS; then the
# driver, runtime, collectives and tools.
NEURON_SYSTEM_PACKAGES = ["aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools"]


def _script(*overrides):
    return pcluster.node_script(pcluster.compose([*REQUIRED, *overrides]))


def test_node_script_matches_golden():
    text = _script()
    if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text.splitlines() == GOLDEN.read_text().splitlines()
    assert subprocess.run(["bash", "-n", str(GOLDEN)]).returncode == 0


def test_compute_nodes_get_the_neuron_driver_runtime_collectives_and_tools():
    text = _script()
    compute = text[text.index("# 3. The Neuron driver"):text.index("# 4. This project")]
    assert 'if [ "$ROLE" = compute ]; then' in compute
    assert ("gpg --batch --yes --dearmor -o /etc/apt/keyrings/neuron.gpg" in compute
            and "https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB" in compute)
    assert "deb [signed-by=/etc/apt/keyrings/neuron.gpg] %s %s main" in compute and '"$VERSION_CODENAME"' in compute
    assert 'apt-get install -y -q "linux-headers-$(uname -r)"' in compute
    assert 'dnf install -y -q "kernel-devel-$(uname -r)" "kernel-headers-$(uname -r)"' in compute
    # Each package once for apt and once for dnf, after the headers, and the driver's devices checked.
    for package in NEURON_SYSTEM_PACKAGES:
        assert compute.count(f"      {package}") == 2, package
    assert compute.index("linux-headers") < compute.index("aws-neuronx-dkms")
    assert "/opt/aws/neuron/bin/neuron-ls" in compute
    # The Python side still comes from the Neuron pip repository, after the system software.
    assert text.index("--extra-index-url https://pip.repos.neuron.amazonaws.com") > text.index("aws-neuronx-tools")


def test_a_neuron_dlami_keeps_its_own_neuron_software():
    text = _script("custom_ami=ami-0123456789abcdef0", "node_setup.neuron_system_packages=[]")
    assert "aws-neuronx" not in text and "apt.repos.neuron" not in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def _training_script(*overrides):
    cfg = resolved("cluster=pcluster_trn1", "training.trainer.accelerator=neuron", "training.trainer.devices=32",
                   "stages=[training]", *overrides)
    return cfg, render(build(cfg)[0], cfg, executor="slurm", produced_by="test")


def test_jobs_run_the_clusters_venv_not_the_launching_interpreter():
    cfg, text = _training_script("python=null")
    assert python(cfg) == "/opt/nxdt/venv/bin/python" != sys.executable
    assert "source /opt/nxdt/venv/bin/activate\n" in text and "\nexport PYTHON=/opt/nxdt/venv/bin/python\n" in text
    # The node script makes that very venv.
    assert pcluster.compose(REQUIRED)["node_setup"]["venv"] == cfg["cluster"]["venv"]


@pytest.mark.parametrize("overrides,expected", [
    (["cluster=pcluster_trn1", "python=/fsx/venv/bin/python"], "/fsx/venv/bin/python"),  # the launch names one
    (["cluster=pcluster_trn1", "container=img.sqsh"], "python3"),                          # the image's
    (["cluster=slurm"], sys.executable),            # no venv named: this one, on a file system the nodes share
    (["cluster=local"], sys.executable),
    (["cluster=slurm", "cluster.venv=/opt/env/"], "/opt/env/bin/python"),
])
def test_which_python_a_job_runs(overrides, expected):
    assert python(resolved("python=null", *overrides)) == expected


def test_a_container_job_does_not_activate_the_host_venv():
    _, text = _training_script("python=null", "container=/fsx/images/neuron.sqsh")
    assert "activate" not in text and "\nexport PYTHON=python3\n" in text


def test_a_relative_venv_is_refused():
    assert cluster_problems(parse_cluster({"venv": "venv"})) == [
        "cluster.venv: 'venv' must be the absolute path of a venv on every node, e.g. cluster.venv=/opt/nxdt/venv"]


@pytest.mark.parametrize("role", ["compute", "head"])
def test_a_checkouts_locked_versions_reach_the_nodes_venv_without_its_torch(role, tmp_path):
    """Section 4 of the real node script, run with a stand-in interpreter whose venv's pip records what it is asked
    (a fake: pip would reach the network): the checkout's constraints.txt is passed, less its torch and triton lines
    (the Neuron packages bring their own torch, which pins its own triton)."""
    text = _script()
    section = text[text.index("# 4. This project"):]
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "constraints.txt").write_text("# lock\nPyYAML==6.0.4\ntorch==2.13.0\nTorch==2.13.0\ntriton==3.9.0\n")
    fake = tmp_path / "python3.11"
    fake.write_text('#!/bin/bash\n[ "$1 $2" = "-m venv" ] || exit 9\nmkdir -p "$3/bin"\n'
                    'printf \'#!/bin/bash\\necho "$*" >> "%s"\\n\' "$3/pip.log" > "$3/bin/pip"\n'
                    'chmod +x "$3/bin/pip"\n')
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    prelude = (f"set -euo pipefail\nROLE={role}\nVENV={venv}\nPYTHON_FOR_VENV={fake}\nPROJECT={checkout}\n"
               f"PATH={tmp_path}:$PATH\n")
    run = subprocess.run(["bash", "-c", prelude + section], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    installs = [line for line in (venv / "pip.log").read_text().splitlines() if "--upgrade pip" not in line]
    assert len(installs) == 1 and installs[0].startswith(f"install -q -c {venv}/constraints.txt ")
    assert (venv / "constraints.txt").read_text() == "# lock\nPyYAML==6.0.4\n"
    assert installs[0].endswith(f"{checkout}[runtime,eval]" if role == "compute" else str(checkout))
    # A wheel or a pip requirement has no constraints.txt beside it: installed as before.
    (checkout / "constraints.txt").unlink()
    (venv / "pip.log").unlink()
    run = subprocess.run(["bash", "-c", prelude + section], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert " -c " not in (venv / "pip.log").read_text()
