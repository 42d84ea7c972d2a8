# Where checkpoints live: a local (or shared) directory, or s3://bucket/prefix. The checkpoint code only needs
# a handful of object operations, so both are small classes with the same methods rather than an fsspec-style
# file system: objects are written whole from a local file, and read whole or by byte range (a loading rank
# reads only the ranges of the rank files it needs: runtime/checkpoint/rankfile.py). That is also the shape S3
# is good at: one PUT (multipart for large objects) per file, ranged GETs in parallel.
#
# Local writes go to a temporary name, are fsynced and renamed into place: a reader (or a crash) never sees half
# an object. S3 PUTs are atomic per object already; boto3's managed transfer splits large ones into parallel
# multipart parts, and botocore retries each request (adaptive mode) on throttling and connection errors. The
# S3 client's endpoint, retries, part size and checksums are the cluster config's (cluster.s3), which the job
# script exports: runtime/io/s3.py reads them, here as for every other S3 client.
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from runtime.io import s3
from runtime.io.files import atomic_write_bytes, temp_name
from runtime.io.s3 import S3Settings, split_url


class Storage(Protocol):
    root: str

    def put_file(self, key: str, local_path: str) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def spool_path(self, key: str) -> str: ...           # where to serialize an object before put_file
    def get_file(self, key: str, local_path: str) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...       # keys under prefix (recursive), relative to root
    def list_dirs(self) -> list[str]: ...                # names directly under root
    def delete_prefix(self, prefix: str) -> None: ...
    def delete(self, key: str) -> None: ...
    def local_path(self, key: str) -> str | None: ...    # a path torch.load can map directly, when there is one
    def reader(self, key: str) -> "RangeReader": ...     # byte-range reads of one object (FileNotFoundError if none)
    read_workers: int                                    # parallel range reads worth running against this storage


class RangeReader(Protocol):
    size: int

    def read_into(self, offset: int, buffers: list[memoryview]) -> int: ...  # bytes read (fewer only at the end)
    # Optional (local files): def map(self, offset: int, length: int) -> memoryview | None
    def close(self) -> None: ...


def open_storage(location: str | os.PathLike, s3_settings: S3Settings | None = None) -> Storage:
    """A directory, s3://bucket/prefix or peer:<registry> (the job's peer stores). S3 settings: the job script's (cluster.s3) unless given."""
    location = str(location)
    if location.startswith("peer:"):  # other nodes' host memory (peer.py)
        from runtime.checkpoint.peer import PeerStorage

        return PeerStorage(location)
    if s3.is_s3(location):
        return S3Storage(location, s3_settings)
    if "://" in location:
        raise ValueError(f"checkpoint directory {location!r}: only local paths and s3://bucket/prefix are supported")
    return LocalStorage(location)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalReader:
    """pread(2) into the caller's buffers: the bytes go from the page cache straight to their destination."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        buffers = [b for b in buffers if len(b)]
        done = 0
        while buffers:
            got = os.preadv(self._fd, buffers[:1024], offset + done)  # at most IOV_MAX buffers per call
            if got == 0:
                break
            done += got
            while buffers and got >= len(buffers[0]):
                got -= len(buffers[0])
                buffers.pop(0)
            if got:
                buffers[0] = buffers[0][got:]
        return done

    def map(self, offset: int, length: int) -> memoryview | None:
        """Bytes [offset, offset + length) mapped copy-on-write (a write stays private; nothing writes), or None
        when the file no longer holds them (read_into then names it truncated). For a gather from scattered rows:
        checksums and copies run straight from the page cache, one pass fewer than a read into a buffer. Rank
        files are never changed in place (writes go to a new name, renamed), so nothing truncates a mapped one;
        safetensors and torch.load(mmap=True) map for the same reason. Pages are faulted in as they are read,
        under crc32, which lets go of the GIL (MAP_POPULATE would fault them in mmap(), which holds it)."""
        if length <= 0 or offset + length > os.fstat(self._fd).st_size:
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self._fd, offset + length - start, access=mmap.ACCESS_COPY, offset=start)
        return memoryview(mapped)[offset - start:]  # the mapping is undone when the last view of it goes

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage:
    def __init__(self, root: str):
        self.root = str(root)
        self._root = Path(root)
        self.reads = 0  # objects read or looked up: a resume from the peers' memory asserts it read none here
        # Ranged reads from the page cache are memory copies plus block checksums: a few threads per rank.
        self.read_workers = max(2, min(8, os.cpu_count() or 2))

    def _path(self, key: str) -> Path:
        return self._root / key

    def put_file(self, key: str, local_path: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if Path(local_path).parent != dest.parent:
            tmp = temp_name(dest)
            shutil.copyfile(local_path, tmp)
            local_path = str(tmp)
        with open(local_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(local_path, dest)
        _fsync_dir(dest.parent)

    def put_bytes(self, key: str, data: bytes) -> None:
        atomic_write_bytes(self._path(key), data)
        _fsync_dir(self._path(key).parent)

    def spool_path(self, key: str) -> str:
        """Where to serialize an object before put_file: next to its final name, so the rename is atomic and
        nothing is copied twice."""
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        return str(temp_name(dest))

    def get_file(self, key: str, local_path: str) -> None:
        self.reads += 1
        shutil.copyfile(self._path(key), local_path)

    def get_bytes(self, key: str) -> bytes:
        self.reads += 1
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        self.reads += 1
        return self._path(key).exists()

    def list(self, prefix: str) -> list[str]:
        self.reads += 1
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self._root).as_posix() for p in base.rglob("*") if p.is_file())

    def list_dirs(self) -> list[str]:
        self.reads += 1
        if not self._root.is_dir():
            return []
        return sorted(p.name for p in self._root.iterdir() if p.is_dir())

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def reader(self, key: str) -> _LocalReader:
        self.reads += 1
        return _LocalReader(self._path(key))


class S3Storage:
    """s3://bucket/prefix through the one S3 client (runtime/io/s3.py)."""

    def __init__(self, url: str, settings: S3Settings | None = None):
        self.bucket, prefix = split_url(url)
        if not self.bucket:
            raise ValueError(f"checkpoint directory {url!r} names no bucket; use s3://bucket/prefix")
        self.prefix = prefix.strip("/")
        self.root = url.rstrip("/")
        self.s3, self.transfer = s3.client(settings)  # None: from the job script's environment
        # Ranged GETs wait on the network: as many in flight as a managed transfer runs parts.
        self.read_workers = max(4, self.transfer.max_request_concurrency)
        self.reads = 0  # requests that read or look up objects (as LocalStorage.reads)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, key: str, local_path: str) -> None:
        self.s3.upload_file(local_path, self.bucket, self._key(key), Config=self.transfer)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def spool_path(self, key: str) -> str:
        fd, path = tempfile.mkstemp(prefix="nxdt_ckpt_", suffix=".pt")
        os.close(fd)
        return path

    def get_file(self, key: str, local_path: str) -> None:
        self.reads += 1
        self.s3.download_file(self.bucket, self._key(key), local_path, Config=self.transfer)

    def get_bytes(self, key: str) -> bytes:
        self.reads += 1
        return self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        self.reads += 1
        try:
            self.s3.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _keys(self, prefix: str, delimiter: str | None = None):
        self.reads += 1
        paginator = self.s3.get_paginator("list_objects_v2")
        full = self._key(prefix)
        kwargs = {"Bucket": self.bucket, "Prefix": full}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        for page in paginator.paginate(**kwargs):
            yield page

    def list(self, prefix: str) -> list[str]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        prefix = prefix.rstrip("/") + "/"
        return sorted(obj["Key"][strip:] for page in self._keys(prefix) for obj in page.get("Contents", []))

    def list_dirs(self) -> list[str]:
        names = []
        for page in self._keys("", delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                names.append(common["Prefix"].rstrip("/").rsplit("/", 1)[-1])
        return sorted(names)

    def delete_prefix(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self.s3.delete_objects(Bucket=self.bucket,
                                   Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))

    def local_path(self, key: str) -> str | None:
        return None

    def reader(self, key: str) -> "_S3Reader":
        return _S3Reader(self, self._key(key))


class _S3Reader:
    """Ranged GETs of one object through the storage's client (boto3 clients are safe to share across threads)."""

    def __init__(self, storage: S3Storage, key: str):
        from botocore.exceptions import ClientError

        self._s3, self._bucket, self._key = storage.s3, storage.bucket, key
        try:
            self.size = int(self._s3.head_object(Bucket=self._bucket, Key=key)["ContentLength"])
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"s3://{self._bucket}/{key}") from None
            raise

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        total = sum(len(b) for b in buffers)
        if total == 0 or offset >= self.size:
            return 0
        body = self._s3.get_object(Bucket=self._bucket, Key=self._key,
                                   Range=f"bytes={offset}-{min(offset + total, self.size) - 1}")["Body"]
        done = 0
        for buffer in buffers:
            filled = 0
            while filled < len(buffer):
                chunk = body.read(len(buffer) - filled)
                if not chunk:
                    return done
                buffer[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
                done += len(chunk)
        return done

    def close(self) -> None:
        pass
