# cluster.s3: how every S3 client of every stage is set up (staging, checkpoints, conversion, evaluation). It
# belongs to the cluster, not to a stage: the endpoint and the limits are the same for everything that runs there.
# The launcher reads it from the cluster config and exports it into each job script; runtime/io/s3.py reads it
# back on the node from that environment, through this same parser, so both sides accept and refuse the same values.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.reader import Report, Section


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None     # None: boto3's own configuration (AWS_ENDPOINT_URL_S3, profiles): AWS S3
    max_concurrency: int = 8            # parts in flight per transfer
    multipart_chunk_mb: int = 64        # multipart threshold and part size of managed transfers
    # Retries of a request (botocore), and tries of a file where staging checks what arrived. Ten ride out the
    # throttling of many ranks saving a checkpoint at once.
    retries: int = 10
    checksums: str = "when_supported"   # botocore's request and response checksum settings (choices.S3_CHECKSUMS)
    # Not a config key: the caller's. Adaptive also slows the client down under throttling; staging, which
    # retries whole files itself, asks for "standard".
    retry_mode: str = "adaptive"


KEYS = ("endpoint_url", "max_concurrency", "multipart_chunk_mb", "retries", "checksums")


def parse_s3(raw: Any, p: str = "cluster.s3.") -> tuple[S3Settings | None, Report]:
    report = Report()
    s = Section(raw, p.rstrip("."), report)
    default = S3Settings()
    values = dict(
        endpoint_url=s.str("endpoint_url", None) or None,  # "" is null too: the job script exports it so
        max_concurrency=s.int("max_concurrency", default.max_concurrency, minimum=1),
        multipart_chunk_mb=s.int("multipart_chunk_mb", default.multipart_chunk_mb, minimum=5),  # S3's least part
        retries=s.int("retries", default.retries, minimum=1),
        checksums=s.choice("checksums", C.S3_CHECKSUMS, default.checksums),
    )
    s.done()
    if values["endpoint_url"]:
        report.error(rules.endpoint_url(values["endpoint_url"], p))
    if report.errors:
        return None, report
    return S3Settings(**values), report
