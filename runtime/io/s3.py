# The one way an S3 client is made, for staging, checkpoints, conversion and evaluation: the endpoint (a given
# one, else boto3's own settings: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, profiles, which is how the tests point
# it at a moto server on loopback), botocore's retries and the managed-transfer sizes are set here only.
# boto3 is imported when a client is made, so importing this module costs nothing where S3 is not used.
from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None     # None: boto3's own configuration decides
    max_attempts: int = 10              # botocore's, per request (throttling and connection errors)
    retry_mode: str = "adaptive"        # botocore's adaptive mode also rate-limits the client under throttling
    part_mb: int = 64                   # multipart threshold and part size of managed transfers
    concurrency: int = 8                # parts in flight per transfer


def client(settings: S3Settings = S3Settings()):
    """(boto3 S3 client, TransferConfig) for these settings."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=settings.endpoint_url or None,
                      config=Config(retries={"max_attempts": settings.max_attempts, "mode": settings.retry_mode},
                                    max_pool_connections=max(10, settings.concurrency * 2)))
    part = settings.part_mb * MiB
    transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                              max_concurrency=settings.concurrency, use_threads=True)
    return s3, transfer
