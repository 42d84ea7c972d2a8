"""The node's staging program (runtime/io/staging.py): transfers between S3 (moto's server, tests/s3_server.py)
and a directory standing in for the shared file system: objects, Megatron prefixes, blend files, multipart files
in parallel parts, integrity checks with retries, skipping what is already there, one-line errors, and the S3
settings taken from the job script's environment (cluster.s3), not from boto3's."""

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from runtime.io import staging
from runtime.io.manifest import BLEND, INDEXED, OBJECT
from runtime.io.s3 import S3Settings, to_env

MiB = 1024 * 1024


def _bucket(s3) -> str:
    name = f"nxdt-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    return name


def _settings(s3) -> S3Settings:
    return S3Settings(endpoint_url=s3.endpoint, max_concurrency=4, multipart_chunk_mb=5, retries=3)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_pull_objects_prefixes_and_blends_then_skip_them(aws_env, tmp_path):
    from boto3.s3.transfer import TransferConfig

    bucket = _bucket(aws_env)
    client = aws_env.client()
    source = tmp_path / "source"
    source.mkdir()
    (source / "big.bin").write_bytes(os.urandom(13 * MiB))   # uploaded in 6 MiB parts: our part size differs
    client.upload_file(str(source / "big.bin"), bucket, "data/demo/shard_text_document.bin",
                       Config=TransferConfig(multipart_threshold=6 * MiB, multipart_chunksize=6 * MiB))
    client.put_object(Bucket=bucket, Key="data/demo/shard_text_document.idx", Body=b"MMIDIDX\x00\x00index")
    client.put_object(Bucket=bucket, Key="data/demo/tokenizer.json", Body=b'{"model": {}}')
    client.put_object(Bucket=bucket, Key="data/demo/blend.txt",
                      Body=f"# weight prefix\n1200 s3://{bucket}/data/demo/shard_text_document demo\n".encode())
    mirror = tmp_path / "fsx"
    manifest = {"local_dir": str(mirror), "pushes": [], "pulls": [
        {"url": f"s3://{bucket}/data/demo/tokenizer.json", "local": str(mirror / bucket / "data/demo/tokenizer.json"),
         "kind": OBJECT},
        {"url": f"s3://{bucket}/data/demo/blend.txt", "local": str(mirror / bucket / "data/demo/blend.txt"),
         "kind": BLEND},
    ]}
    log: list[str] = []
    assert staging.pull(manifest, _settings(aws_env), log=log.append) == 4
    demo = mirror / bucket / "data" / "demo"
    assert _md5(demo / "shard_text_document.bin") == _md5(source / "big.bin")
    assert (demo / "shard_text_document.idx").read_bytes() == b"MMIDIDX\x00\x00index"
    assert (demo / "tokenizer.json").read_text() == '{"model": {}}'
    # The local blend names the local mirror: the trainer reads it as it reads any blend file.
    assert (demo / "blend.txt").read_text() == f"# weight prefix\n1200 {demo / 'shard_text_document'} demo\n"
    assert not [p for p in demo.iterdir() if ".part-" in p.name]
    # Unchanged objects are not fetched again.
    assert staging.pull(manifest, _settings(aws_env), log=log.append) == 0
    # A changed object is.
    client.put_object(Bucket=bucket, Key="data/demo/tokenizer.json", Body=b'{"model": {"v": 2}}')
    assert staging.pull(manifest, _settings(aws_env), log=log.append) == 1
    assert (demo / "tokenizer.json").read_text() == '{"model": {"v": 2}}'
    # A Megatron prefix by itself: both halves.
    indexed = {**manifest, "local_dir": str(tmp_path / "other"), "pulls": [
        {"url": f"s3://{bucket}/data/demo/shard_text_document", "local": "unused", "kind": INDEXED}]}
    assert staging.pull(indexed, _settings(aws_env), log=log.append) == 2


def test_a_corrupted_download_is_retried_then_refused(aws_env, tmp_path, monkeypatch):
    bucket = _bucket(aws_env)
    aws_env.client().put_object(Bucket=bucket, Key="x.json", Body=b"0123456789")
    manifest = {"local_dir": str(tmp_path), "pushes": [], "pulls": [
        {"url": f"s3://{bucket}/x.json", "local": str(tmp_path / "x.json"), "kind": OBJECT}]}
    real_download = staging._Sync.__init__
    corrupt = {"times": 1}

    def init(self, local_dir, settings, log):
        # FAKE network fault: the first `corrupt["times"]` downloads arrive with one byte flipped.
        real_download(self, local_dir, settings, log)
        download = self.s3.download_file

        def flaky(bucket, key, filename, Config=None):
            download(bucket, key, filename, Config=Config)
            if corrupt["times"] > 0:
                corrupt["times"] -= 1
                data = bytearray(Path(filename).read_bytes())
                data[0] ^= 0xFF
                Path(filename).write_bytes(bytes(data))

        self.s3.download_file = flaky

    monkeypatch.setattr(staging._Sync, "__init__", init)
    log: list[str] = []
    assert staging.pull(manifest, _settings(aws_env), log=log.append) == 1
    assert (tmp_path / "x.json").read_bytes() == b"0123456789"
    assert any("checksum mismatch" in line and "attempt 1 of 3" in line for line in log), log
    (tmp_path / "x.json").unlink()
    corrupt["times"] = 99
    with pytest.raises(staging.StagingError, match=r"x.json: checksum mismatch: .* after 3 attempts"):
        staging.pull(manifest, _settings(aws_env), log=log.append)
    assert not (tmp_path / "x.json").exists(), "an unverified file must never take the real name"


def test_push_uploads_in_parts_verifies_and_skips_what_is_there(aws_env, tmp_path):
    bucket = _bucket(aws_env)
    mirror = tmp_path / "fsx"
    out = mirror / bucket / "data" / "demo"
    out.mkdir(parents=True)
    (out / "shard_text_document.bin").write_bytes(os.urandom(11 * MiB))
    (out / "shard_text_document.idx").write_bytes(b"idx")
    (out / "blend.txt").write_text(f"1200 {out / 'shard_text_document'}\n")
    (out / "half.bin.tmp").write_bytes(b"in progress")
    (out / ".hidden").write_text("x")
    manifest = {"local_dir": str(mirror), "pulls": [],
                "pushes": [{"url": f"s3://{bucket}/data/demo", "local": str(out), "kind": "tree"}]}
    assert staging.push(manifest, _settings(aws_env), log=print) == 3
    client = aws_env.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == ["data/demo/blend.txt", "data/demo/shard_text_document.bin", "data/demo/shard_text_document.idx"]
    big = client.head_object(Bucket=bucket, Key="data/demo/shard_text_document.bin")
    assert big["ETag"].strip('"').endswith("-3"), "11 MiB in 5 MiB parts is a three-part upload"
    blend = client.get_object(Bucket=bucket, Key="data/demo/blend.txt")["Body"].read().decode()
    assert blend == f"1200 s3://{bucket}/data/demo/shard_text_document\n", "S3 keeps location-free blends"
    assert staging.push(manifest, _settings(aws_env), log=print) == 0


def _run(tmp_path, manifest: dict, env: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(manifest))
    return subprocess.run([sys.executable, "-m", "runtime.io.staging", "pull", str(path)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_the_program_reads_the_endpoint_the_job_script_exports(s3, tmp_path):
    """As a job script runs it: cluster.s3 arrives as NXDT_S3_*, and wins over boto3's own AWS_ENDPOINT_URL
    (here a port nothing listens on)."""
    bucket = _bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="t.json", Body=b"{}")
    manifest = {"local_dir": str(tmp_path), "pushes": [], "pulls": [
        {"url": f"s3://{bucket}/t.json", "local": str(tmp_path / "t.json"), "kind": OBJECT}]}
    env = {**s3.env, **to_env(_settings(s3)), "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    result = _run(tmp_path, manifest, env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "t.json").read_bytes() == b"{}"
    assert "staging pull: 1 file(s) transferred" in result.stdout


def test_a_missing_object_is_one_error_line(s3, tmp_path):
    manifest = {"local_dir": str(tmp_path), "pushes": [], "pulls": [
        {"url": "s3://nxdt-no-such-bucket/none.json", "local": str(tmp_path / "none.json"), "kind": OBJECT}]}
    result = _run(tmp_path, manifest, {**s3.env, **to_env(_settings(s3))})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: staging pull: s3://nxdt-no-such-bucket/none.json: no such object (check the bucket and key, "
        "and that this node may read it)"], result.stderr


def test_a_bad_exported_setting_names_its_config_key(tmp_path):
    manifest = {"local_dir": str(tmp_path), "pushes": [], "pulls": []}
    result = _run(tmp_path, manifest, {"NXDT_S3_RETRIES": "many", "NXDT_S3_MAX_CONCURRENCY": "0"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: staging pull: cluster.s3.max_concurrency: 0 must be a positive integer",
        "error: staging pull: cluster.s3.retries: 'many' is not an integer"], result.stderr
