# The one way an S3 client is made, for staging, checkpoints, conversion and evaluation. Its settings come from
# one place, the cluster config's `cluster.s3` (runtime/schema/s3.py): the launcher exports them into every job
# script as NXDT_S3_* (to_env) and each program reads them back here (from_env), so that the endpoint, retries,
# transfer sizes and checksums of a checkpoint save are those of a staging pull. Where nothing was exported (a
# program run by hand, a test), the defaults apply and the endpoint is boto3's own (AWS_ENDPOINT_URL_S3 /
# AWS_ENDPOINT_URL, profiles). boto3 is imported when a client is made: importing this costs nothing.
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from runtime.schema.s3 import KEYS, S3Settings, parse_s3

__all__ = ["ENV", "S3Settings", "client", "from_env", "is_s3", "split_url", "to_env"]

MiB = 1024 * 1024
ENV = {key: f"NXDT_S3_{key.upper()}" for key in KEYS}


def is_s3(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/key/of/object -> (bucket, key/of/object)."""
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def to_env(settings: S3Settings) -> dict[str, str]:
    """The variables a job script exports. A null endpoint is exported empty, so that one left in the submitting
    shell's environment (Slurm passes it on) cannot stand in for the config's."""
    return {ENV[key]: "" if getattr(settings, key) is None else str(getattr(settings, key)) for key in KEYS}


def from_env(environ: Mapping[str, str] = os.environ) -> S3Settings:
    """The settings the job script exported. A bad value is a ConfigErrors naming its cluster.s3 key, with the
    message the launcher would have given."""
    raw = {key: _number_or_text(environ[name]) for key, name in ENV.items() if name in environ}
    settings, report = parse_s3(raw)
    report.raise_if_any()
    return settings


def _number_or_text(text: str) -> int | str:
    # Environment values are text; the parser checks types, so hand it the integer where the text is one.
    return int(text) if re.fullmatch(r"\s*-?\d+\s*", text) else text


def client(settings: S3Settings | None = None):
    """(boto3 S3 client, TransferConfig), by default for the settings the job script exported."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    settings = settings or from_env()
    # Explicit, so that a node's AWS config file cannot switch checksums off behind the cluster config's back.
    s3 = boto3.client("s3", endpoint_url=settings.endpoint_url,
                      config=Config(retries={"max_attempts": settings.retries, "mode": settings.retry_mode},
                                    max_pool_connections=max(10, settings.max_concurrency * 2),
                                    request_checksum_calculation=settings.checksums,
                                    response_checksum_validation=settings.checksums))
    part = settings.multipart_chunk_mb * MiB
    transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                              max_concurrency=settings.max_concurrency, use_threads=True)
    return s3, transfer
