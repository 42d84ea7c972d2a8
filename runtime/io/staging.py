"""`python -m runtime.io.staging pull|push MANIFEST`: what a job script runs on the node before its program (pull
the stage's S3 inputs to the shared file system) and after it succeeds (push its outputs back). The manifest is
the launcher's plan (runtime/io/manifest.py); the S3 client's settings are the cluster's (runtime/io/s3.py).

The transfers are boto3's managed ones (parallel multipart parts), with botocore's retries per request and an
integrity check of every file that retries the file when it fails: the size, and S3's ETag recomputed from the
local bytes (the MD5 for a single-part object; the MD5 of the parts' MD5s and the part count for a multipart one).

A pulled file is written under a temporary name and renamed into place once verified, so a reader never
sees half a file; a small record of the object's ETag next to the mirror (`.nxdt-staging/`) lets a second
pull of an unchanged object skip it. Array tasks that pull the same inputs take a lock per file.

    python -m runtime.io.staging pull /fsx/results/gpt3_tiny/training/training_staging.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from runtime.io import s3
from runtime.io.manifest import BLEND, INDEXED, OBJECT, mirror
from runtime.io.s3 import split_url
from runtime.schema.data_prefix import map_blend_prefixes
from runtime.schema.facts import USER_ERROR_EXIT_CODE
from runtime.schema.reader import ConfigErrors

RECORDS = ".nxdt-staging"
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^[0-9a-f]{32}-(\d+)$")
MiB = 1024 * 1024


class StagingError(Exception):
    """A transfer that failed for good; the message names the object."""


class _Sync:
    def __init__(self, local_dir: str, settings: s3.S3Settings, log: Callable[[str], None]):
        self.log = log
        self.retries = settings.retries
        self.local_dir = Path(local_dir)
        # Staging verifies and retries whole files itself, so botocore's own retries stay plain ("standard").
        self.s3, self.transfer = s3.client(dataclasses.replace(settings, retry_mode="standard"))

    # --- what S3 holds --------------------------------------------------------------------------------
    def head(self, url: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        bucket, key = split_url(url)
        try:
            return self.s3.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise StagingError(f"{url}: {e}") from None

    def part_size(self, url: str, etag: str) -> int | None:
        """The size of the object's first part (all but the last have it), to recompute a multipart ETag."""
        if not _MULTIPART.match(etag):
            return None
        bucket, key = split_url(url)
        try:
            return int(self.s3.head_object(Bucket=bucket, Key=key, PartNumber=1)["ContentLength"])
        except Exception:  # an endpoint without part lookups: the size check still applies
            return None

    # --- bookkeeping on the shared file system -------------------------------------------------------
    def _record_path(self, local: Path) -> Path:
        try:
            relative = local.relative_to(self.local_dir)
        except ValueError:
            relative = Path(*local.parts[1:])
        return self.local_dir / RECORDS / f"{relative}.json"

    def _recorded_etag(self, local: Path) -> str | None:
        try:
            return json.loads(self._record_path(local).read_text()).get("etag")
        except (OSError, ValueError):
            return None

    def _record(self, local: Path, etag: str, size: int) -> None:
        path = self._record_path(local)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"etag": etag, "size": size}))

    @contextlib.contextmanager
    def _lock(self, local: Path):
        path = self._record_path(local).with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            with contextlib.suppress(OSError):  # a file system without flock: atomic renames still hold
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    # --- transfers ----------------------------------------------------------------------------------
    def pull_object(self, url: str, local: Path, rewrite: Callable[[Path], None] | None = None) -> bool:
        """Fetch one object unless the mirror already holds this version. True when bytes moved."""
        head = self.head(url)
        if head is None:
            raise StagingError(f"{url}: no such object (check the bucket and key, and that this node may read it)")
        size, etag = int(head["ContentLength"]), head["ETag"].strip('"')
        with self._lock(local):
            if local.exists() and self._recorded_etag(local) == etag:
                return False
            local.parent.mkdir(parents=True, exist_ok=True)
            bucket, key = split_url(url)
            part_size = self.part_size(url, etag)
            for attempt in range(1, self.retries + 1):
                part = local.with_name(f".{local.name}.part-{os.getpid()}")
                started = time.monotonic()
                self.s3.download_file(bucket, key, str(part), Config=self.transfer)
                problem = mismatch(part, size, etag, part_size)
                if problem is None:
                    if rewrite is not None:
                        rewrite(part)
                    os.replace(part, local)
                    self._record(local, etag, size)
                    self.log(f"pulled {url} -> {local} ({size / MiB:.1f} MiB, {time.monotonic() - started:.1f}s)")
                    return True
                part.unlink(missing_ok=True)
                self.log(f"{url}: {problem} (attempt {attempt} of {self.retries})")
            raise StagingError(f"{url}: {problem} after {self.retries} attempts")

    def pull_blend(self, url: str, local: Path) -> int:
        """A blend file: its s3:// prefixes are pulled too, and rewritten to their mirrors in the local copy."""
        prefixes: list[str] = []

        def rewrite(path: Path) -> None:
            text, found = map_blend_prefixes(
                path.read_text(), lambda p: mirror(p, str(self.local_dir)) if p.startswith("s3://") else None)
            prefixes.extend(p for p in found if p.startswith("s3://"))
            path.write_text(text)

        moved = int(self.pull_object(url, local, rewrite))
        if not prefixes:  # already mirrored: read the prefixes back from the recorded local copy
            prefixes = [self._unmirror(p) for p in map_blend_prefixes(local.read_text(), lambda p: None)[1]]
        for prefix in filter(None, prefixes):
            moved += self.pull_indexed(prefix)
        return moved

    def pull_indexed(self, url: str) -> int:
        local = Path(mirror(url, str(self.local_dir)))
        return sum(self.pull_object(url + suffix, Path(str(local) + suffix)) for suffix in (".bin", ".idx"))

    def _unmirror(self, path: str) -> str | None:
        try:
            bucket, *key = Path(path).relative_to(self.local_dir).parts
        except ValueError:
            return None  # a prefix on the shared file system itself: nothing to fetch
        return f"s3://{bucket}/{'/'.join(key)}"

    def push_tree(self, local_root: Path, url: str) -> int:
        """Upload every file under local_root (not temporary or hidden ones) that S3 does not already hold."""
        if not local_root.is_dir():
            raise StagingError(f"{local_root}: the stage wrote no output directory to push to {url}")
        files = sorted(p for p in local_root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(local_root).parts)
                       and not p.name.endswith((".tmp", ".part", ".lock")))
        with ThreadPoolExecutor(max_workers=4) as pool:
            return sum(pool.map(lambda p: self.push_file(p, f"{url.rstrip('/')}/{p.relative_to(local_root)}"),
                                files))

    def push_file(self, local: Path, url: str) -> bool:
        source = local
        if local.name == "blend.txt":  # S3 keeps a blend that names S3 prefixes, valid wherever it is pulled
            source = local.with_name(f".{local.name}.push-{os.getpid()}")
            source.write_text(self._blend_for_s3(local.read_text()))
        try:
            size = source.stat().st_size
            expected = local_etag(source, self.transfer.multipart_threshold, self.transfer.multipart_chunksize)
            head = self.head(url)
            if head is not None and int(head["ContentLength"]) == size and head["ETag"].strip('"') == expected:
                return False
            bucket, key = split_url(url)
            for attempt in range(1, self.retries + 1):
                self.s3.upload_file(str(source), bucket, key, Config=self.transfer)
                head = self.head(url) or {}
                got = str(head.get("ETag", "")).strip('"')
                if int(head.get("ContentLength", -1)) == size and got == expected:
                    self.log(f"pushed {local} -> {url} ({size / MiB:.1f} MiB)")
                    return True
                self.log(f"{url}: S3 holds {head.get('ContentLength')} bytes, ETag {got}; expected {size}, "
                         f"{expected} (attempt {attempt} of {self.retries})")
            raise StagingError(f"{url}: upload of {local} did not verify after {self.retries} attempts")
        finally:
            if source is not local:
                source.unlink(missing_ok=True)

    def _blend_for_s3(self, text: str) -> str:
        return map_blend_prefixes(text, self._unmirror)[0]


def local_etag(path: Path, threshold: int, chunk: int) -> str:
    """The ETag S3 gives this file when boto3 uploads it with this TransferConfig."""
    from s3transfer.utils import ChunksizeAdjuster

    size = path.stat().st_size
    if size < threshold:
        return _md5_parts(path, None)[0]
    return _multipart_etag(path, ChunksizeAdjuster().adjust_chunksize(chunk, size))


def _md5_parts(path: Path, part_size: int | None) -> list[str]:
    digests, whole = [], hashlib.md5()
    with open(path, "rb") as f:
        while True:
            block = f.read(part_size or 8 * MiB)
            if not block:
                break
            (digests.append(hashlib.md5(block).hexdigest()) if part_size else whole.update(block))
    return digests if part_size else [whole.hexdigest()]


def _multipart_etag(path: Path, part_size: int) -> str:
    parts = _md5_parts(path, part_size)
    return hashlib.md5(b"".join(bytes.fromhex(d) for d in parts)).hexdigest() + f"-{len(parts)}"


def mismatch(path: Path, size: int, etag: str, part_size: int | None) -> str | None:
    """Why the local file is not the object (size, then ETag), or None. An ETag that is no MD5 (SSE-KMS,
    an unknown part size) leaves the size as the check."""
    got = path.stat().st_size
    if got != size:
        return f"size mismatch: {got} bytes fetched, S3 says {size}"
    if _MD5.match(etag):
        local = _md5_parts(path, None)[0]
    elif _MULTIPART.match(etag) and part_size:
        local = _multipart_etag(path, part_size)
    else:
        return None
    return None if local == etag else f"checksum mismatch: local ETag {local}, S3 ETag {etag}"


def pull(manifest: dict[str, Any], settings: s3.S3Settings | None = None, log: Callable[[str], None] = print) -> int:
    """Every pull of the manifest; the number of files that moved. Settings: the job script's (from_env)."""
    sync = _Sync(manifest["local_dir"], settings or s3.from_env(), log)

    def one(entry: dict[str, str]) -> int:
        local = Path(entry["local"])
        if entry["kind"] == BLEND:
            return sync.pull_blend(entry["url"], local)
        if entry["kind"] == INDEXED:
            return sync.pull_indexed(entry["url"])
        assert entry["kind"] == OBJECT, entry
        return int(sync.pull_object(entry["url"], local))

    with ThreadPoolExecutor(max_workers=4) as pool:
        return sum(pool.map(one, manifest["pulls"]))


def push(manifest: dict[str, Any], settings: s3.S3Settings | None = None, log: Callable[[str], None] = print) -> int:
    sync = _Sync(manifest["local_dir"], settings or s3.from_env(), log)
    return sum(sync.push_tree(Path(entry["local"]), entry["url"]) for entry in manifest["pushes"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.io.staging",
                                     description="Copy a stage's S3 inputs in (pull) or its outputs out (push).")
    parser.add_argument("direction", choices=("pull", "push"))
    parser.add_argument("manifest", type=Path, help="the <stage>_staging.json the launcher wrote")
    args = parser.parse_args(argv)
    manifest = json.loads(args.manifest.read_text())
    try:
        moved = (pull if args.direction == "pull" else push)(manifest, log=print)
    except (StagingError, ConfigErrors) as e:
        for problem in getattr(e, "problems", [str(e)]):  # a bad NXDT_S3_* value names its cluster.s3 key
            print(f"error: staging {args.direction}: {problem}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    print(f"nxdt: staging {args.direction}: {moved} file(s) transferred", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
