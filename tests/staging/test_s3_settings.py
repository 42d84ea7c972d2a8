"""cluster.s3 is the one source of every S3 client's settings: the launcher checks it with the schema's parser,
exports it into each job script, and the node reads back exactly what the config said, through the same parser.
Nothing here contacts S3."""

import pytest

from launcher.render import s3_env
from runtime.io import s3
from runtime.schema.s3 import S3Settings, parse_s3
from tests.launcher.helpers import nxdt, resolved


@pytest.mark.parametrize("overrides", [[], ["cluster.s3.endpoint_url=http://minio.internal:9000",
                                            "cluster.s3.retries=3", "cluster.s3.checksums=when_required"]])
def test_what_the_job_script_exports_is_what_the_node_reads(overrides):
    cfg = resolved("stages=[training]", *overrides)
    from_config, report = parse_s3(cfg["cluster"]["s3"])
    assert not report.errors
    assert s3.from_env(s3_env(cfg)) == from_config


def test_the_conf_files_hold_the_defaults_of_the_code():
    for cluster in ("slurm", "local", "pcluster_trn1"):
        assert parse_s3(resolved(f"cluster={cluster}")["cluster"]["s3"])[0] == S3Settings(), cluster


def test_nothing_exported_means_the_defaults_and_boto3s_own_endpoint():
    assert s3.from_env({}) == S3Settings() and S3Settings().endpoint_url is None


def test_the_client_is_made_with_the_settings():
    client, transfer = s3.client(S3Settings(endpoint_url="http://127.0.0.1:9", max_concurrency=3,
                                            multipart_chunk_mb=16, retries=4, checksums="when_required"))
    config = client.meta.config
    assert client.meta.endpoint_url == "http://127.0.0.1:9"
    assert config.retries == {"total_max_attempts": 5, "mode": "adaptive"}  # the first try and 4 retries
    assert (config.request_checksum_calculation, config.response_checksum_validation) == ("when_required",) * 2
    assert (transfer.multipart_chunksize, transfer.max_concurrency) == (16 * s3.MiB, 3)


@pytest.mark.parametrize("override, expected", [
    ("cluster.s3.retries=0", "cluster.s3.retries: 0 must be a positive integer"),
    ("cluster.s3.max_concurrency=many", "cluster.s3.max_concurrency: 'many' is not an integer"),
    ("cluster.s3.multipart_chunk_mb=1", "cluster.s3.multipart_chunk_mb: 1 must be an integer >= 5"),
    ("cluster.s3.endpoint_url=minio:9000", "cluster.s3.endpoint_url: 'minio:9000' is not an http:// or https:// URL"),
    ("cluster.s3.checksums=always", "cluster.s3.checksums: 'always' is not one of when_supported, when_required"),
    ("+cluster.staging.retries=3", "cluster.staging.retries: moved to cluster.s3.retries"),
])
def test_a_bad_setting_is_one_error_line_and_nothing_is_written(tmp_path, override, expected):
    result = nxdt(f"base_results_dir={tmp_path}/results", "cluster_type=local", "stages=[training]", override,
                  "--dry-run", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == \
        [line for line in result.stderr.splitlines() if line.strip()], result.stderr
    assert any(line.startswith(f"error: {expected}") for line in result.stderr.splitlines()), result.stderr
    assert not (tmp_path / "results").exists()
