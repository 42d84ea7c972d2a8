"""`nxdt-launch cluster-config`: the rendered AWS ParallelCluster configs for trn1, trn1n and trn2 pass
ParallelCluster's own schema (aws-parallelcluster, in its own venv: .venv-pcluster or NXDT_PCLUSTER_PYTHON),
and bad values come back as one `error:` line each, naming the key, with nothing written.

The schema check runs offline: no AWS credentials, instance metadata off, and a FAKE in the checking
process (launcher/pcluster.py _SCHEMA_CHECK) that refuses every AWS API call and non-loopback connection;
`skipped_aws_calls` shows that none was even attempted for these configs."""

import os
import subprocess

import pytest
import yaml

from launcher import pcluster
from tests.launcher.helpers import REPO, nxdt

GOLDEN = REPO / "tests" / "golden"
REQUIRED = ["subnet_id=subnet-0123456789abcdef0", "node_setup.script_s3_uri=s3://my-bucket/nxdt/on_node_configured.sh"]


@pytest.fixture(scope="module")
def pcluster_python():
    python = pcluster.find_python()
    if python is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI is set but aws-parallelcluster is missing: {pcluster.INSTALL_HINT}", pytrace=False)
        pytest.skip(f"aws-parallelcluster not installed: {pcluster.INSTALL_HINT}")
    return python


@pytest.mark.parametrize("instance,instance_type", [("trn1", "trn1.32xlarge"), ("trn1n", "trn1n.32xlarge"),
                                                    ("trn2", "trn2.48xlarge")])
def test_each_trainium_queue_passes_parallelclusters_schema(pcluster_python, instance, instance_type):
    cfg = pcluster.compose([*REQUIRED, f"instance={instance}", "s3_access=[my-data]"])
    config = pcluster.cluster_yaml(cfg)
    verdict = pcluster.schema_check(config, "nxdt", pcluster_python)
    assert verdict == {"errors": None, "skipped_aws_calls": []}
    (queue,) = config["Scheduling"]["SlurmQueues"]
    (resource,) = queue["ComputeResources"]
    assert queue["Name"] == instance and resource["InstanceType"] == instance_type
    assert resource["Efa"] == {"Enabled": True} and queue["Networking"]["PlacementGroup"] == {"Enabled": True}
    assert config["SharedStorage"][0]["StorageType"] == "FsxLustre"
    assert config["Image"]["Os"] == "ubuntu2204"
    assert queue["CustomActions"]["OnNodeConfigured"] == {"Script": REQUIRED[1].split("=", 1)[1], "Args": ["compute"]}
    assert {"BucketName": "my-data", "EnableWriteAccess": True} in queue["Iam"]["S3Access"]


def test_custom_neuron_ami_existing_fsx_and_capacity_block_pass(pcluster_python):
    config, script, cfg = pcluster.render([*REQUIRED, "instance=trn2", "custom_ami=ami-0123456789abcdef0",
                                           "fsx.file_system_id=fs-0123456789abcdef0", "queue.capacity_type=CAPACITY_BLOCK",
                                           "queue.capacity_reservation_id=cr-0123456789abcdef0",
                                           "extra.Monitoring.DetailedMonitoring=true"])
    assert config["Image"] == {"Os": "ubuntu2204", "CustomAmi": "ami-0123456789abcdef0"}
    assert config["SharedStorage"][0]["FsxLustreSettings"] == {"FileSystemId": "fs-0123456789abcdef0"}
    assert config["Monitoring"] == {"DetailedMonitoring": True}


def test_rendered_files_match_golden(pcluster_python, tmp_path):
    result = nxdt("cluster-config", *REQUIRED, "-o", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "passes ParallelCluster 3.16.1's schema" in result.stdout
    pairs = [(tmp_path / "nxdt.yaml", GOLDEN / "pcluster.trn1.yaml"),
             (tmp_path / "on_node_configured.sh", GOLDEN / "pcluster_on_node_configured.trn1.sh")]
    for rendered, golden in pairs:
        if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
            golden.write_text(rendered.read_text())
        assert rendered.read_text().splitlines() == golden.read_text().splitlines(), golden.name
    assert subprocess.run(["bash", "-n", str(tmp_path / "on_node_configured.sh")]).returncode == 0
    assert yaml.safe_load((tmp_path / "nxdt.yaml").read_text())["Region"] == "us-east-1"


BAD = [
    (["extra.HeadNode.Bogus=1"], "error: ParallelCluster schema: HeadNode.Bogus: Unknown field."),
    (["os=windows"], "error: ParallelCluster schema: Image.Os (from os=windows): Must be one of: alinux2023, ubuntu2204"),
    (["queue.max_count=0"], "error: ParallelCluster schema: Scheduling.SlurmQueues[0].ComputeResources[0].MaxCount "
                            "(from queue.max_count=0): Must be greater than or equal to 1."),
    (["queue.maxcount=2"], "error: unknown key 'queue.maxcount': valid keys there: capacity_reservation_id"),
    (["instance=trn3"], "error: instance=trn3: no such choice; valid choices: trn1, trn1n, trn2"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[b[0][0] for b in BAD])
def test_a_bad_value_is_one_error_line_and_nothing_is_written(pcluster_python, tmp_path, overrides, expected):
    result = nxdt("cluster-config", *REQUIRED, *overrides, "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(expected), \
        result.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_required_value_names_it(tmp_path):
    result = nxdt("cluster-config", REQUIRED[1], "--no-validate", "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: subnet_id: Missing mandatory value: subnet_id; set it, e.g. subnet_id=..."


def test_without_aws_parallelcluster_the_error_says_how_to_install_it(tmp_path):
    result = nxdt("cluster-config", *REQUIRED, "-o", str(tmp_path / "out"), cwd=tmp_path,
                  env={"NXDT_PCLUSTER_PYTHON": str(tmp_path / "no-such-python")})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cluster-config: cannot run the ParallelCluster schema check with")
