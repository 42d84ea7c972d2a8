# Rank-file checksums. Each rank hashes its file while the storage makes it durable (the fsync of a local file,
# the upload of an S3 one), so the hash costs no time on the save's critical path; the digest goes into the
# rank's .done marker and rank 0 copies every rank's into COMMIT. Before anything is loaded, the files are
# checked against COMMIT: a flipped byte, a truncated or a missing file is named, and resume falls back to an
# older checkpoint instead of training on it. Checkpoints from before checksums are checked by opening each file.
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Callable

import torch

from runtime.io.files import sha256_file

ALGORITHM = "sha256"  # hashlib's OpenSSL SHA-256 runs at >1.5 GB/s and releases the GIL while it hashes


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match what its COMMIT marker recorded; the message names the file."""


def _digest(f) -> dict:
    digest = sha256_file(f)
    return {ALGORITHM: digest, "bytes": f.tell()}


def file_digest(path: str) -> dict:
    with open(path, "rb") as f:
        return _digest(f)


def digest_while(path: str, publish: Callable[[], None]) -> dict:
    """file_digest(path), computed on a second thread while `publish()` runs. The file is opened first, so
    publishing may rename or remove it."""
    result: dict = {}
    f = open(path, "rb")

    def run() -> None:
        try:
            with f:
                result["digest"] = _digest(f)
        except BaseException as error:  # re-raised below, on the caller's thread
            result["error"] = error

    worker = threading.Thread(target=run, name="nxdt-checkpoint-digest", daemon=True)
    worker.start()
    try:
        publish()
    finally:
        worker.join()
    if "error" in result:
        raise result["error"]
    return result["digest"]


def _readable_copy(storage, key: str) -> tuple[str, str | None]:
    """A local path holding `key` and the scratch directory to remove afterwards (None for local storage)."""
    path = storage.local_path(key)
    if path is not None:
        return path, None
    scratch = tempfile.mkdtemp(prefix="nxdt_ckpt_verify_")
    path = os.path.join(scratch, os.path.basename(key))
    storage.get_file(key, path)
    return path, scratch


def check_file(storage, name: str, filename: str, expected: dict | None) -> str | None:
    """Why `filename` of checkpoint `name` cannot be trusted, or None when it can."""
    key = f"{name}/{filename}"
    if not storage.exists(key):
        return f"{filename} is missing"
    path, scratch = _readable_copy(storage, key)
    try:
        if expected is None:  # written before checksums: at least the file must open
            try:
                torch.load(path, mmap=True, weights_only=True)
            except Exception as error:  # noqa: BLE001 - torch raises several kinds for a damaged zip
                return f"{filename} cannot be read ({' '.join(str(error).split())[:160]})"
            return None
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return f"{filename} holds {size} bytes where {expected['bytes']} were written (truncated or overwritten)"
        if file_digest(path)[ALGORITHM] != expected[ALGORITHM]:
            return f"{filename} does not match its {ALGORITHM} checksum (damaged)"
        return None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def rank_file_names(meta: dict) -> list[str]:
    files = meta.get("files")
    if files:
        return sorted(files)
    return [f"rank_{r:05d}.pt" for r in range(int(meta.get("world_size", 1)))]


def check_checkpoint(storage, checkpoint, share: tuple[int, int] = (0, 1)) -> str | None:
    """Check this caller's share of the checkpoint's rank files: share = (index, count) takes every count-th
    file from index, so the ranks of a job split the work. The first problem found, or None."""
    index, count = share
    if "unreadable" in checkpoint.meta:
        return checkpoint.meta["unreadable"]
    recorded = checkpoint.meta.get("files") or {}
    for filename in rank_file_names(checkpoint.meta)[index::count]:
        problem = check_file(storage, checkpoint.name, filename, recorded.get(filename))
        if problem is not None:
            return problem
    return None
