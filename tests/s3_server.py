"""moto's S3 in server mode on 127.0.0.1 (a FAKE of AWS S3, run as a real HTTP server so that boto3 exercises
its real transfer code), once per session, stopped at the end even on failure. Tests reach it through
`s3.endpoint` and the credentials in `s3.env` (moto accepts any)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.servers import free_port, stop, wait_for_port


@dataclass
class FakeS3:
    endpoint: str
    env: dict[str, str]      # credentials and region for boto3 in a subprocess; never real ones

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    server = shutil.which("moto_server") or shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if server is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set but moto_server is missing (pip install 'moto[server]')", pytrace=False)
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc, log, "moto_server", timeout=30)
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
               "AWS_CONFIG_FILE": "/dev/null"}
        yield FakeS3(f"http://127.0.0.1:{port}", env)
    finally:
        stop(proc)


@pytest.fixture
def aws_env(s3, monkeypatch):
    """This process's boto3 talks to the fake with fake credentials."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3
