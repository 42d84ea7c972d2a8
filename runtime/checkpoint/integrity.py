# Rank-file checksums. A rank file (format 2, rankfile.py) carries the crc32 of every 1 MiB block of its tensors
# in its index, computed from memory while the file is written; the rank's .done marker holds the file's size
# and the sha256 of that index, and rank 0 copies every rank's into COMMIT. So checking costs nothing on the
# save's critical path, and a load that reads only some byte ranges still checks every byte it uses. Before a
# resume, the ranks check the candidate's files against COMMIT, each its share, every block: a flipped byte, a
# truncated or a missing file is named, and resume falls back to an older checkpoint instead of training on it.
# Format-1 files (a torch.save zip, whole-file sha256) are checked as they were; files from before checksums
# by opening them.
from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

from runtime.checkpoint.rankfile import FOOTER, DamagedFile, RankFile, check_rank_file, is_rank_file
from runtime.io.files import sha256_file

ALGORITHM = "sha256"  # format 1's whole-file checksum; hashlib's SHA-256 releases the GIL while it hashes


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match what its COMMIT marker recorded; the message names the file."""


def file_digest(path: str) -> dict:
    with open(path, "rb") as f:
        return {ALGORITHM: sha256_file(f), "bytes": f.tell()}


def _readable_copy(storage, key: str) -> tuple[str, str | None]:
    """A local path holding `key` and the scratch directory to remove afterwards (None for local storage)."""
    path = storage.local_path(key)
    if path is not None:
        return path, None
    scratch = tempfile.mkdtemp(prefix="nxdt_ckpt_verify_")
    path = os.path.join(scratch, os.path.basename(key))
    storage.get_file(key, path)
    return path, scratch


def _check_indexed(storage, key: str, expected: dict | None) -> str | None:
    """Every block of a format-2 rank file, read by range (in parallel, nothing downloaded whole)."""
    try:
        file = RankFile(storage, key, expected)
    except DamagedFile as problem:
        return str(problem)
    try:
        with ThreadPoolExecutor(storage.read_workers, thread_name_prefix="nxdt-checkpoint-check") as pool:
            check_rank_file(file, pool)
    except DamagedFile as problem:
        return str(problem)
    finally:
        file.close()
    return None


def _has_footer(storage, key: str) -> bool:
    reader = storage.reader(key)
    try:
        tail = bytearray(FOOTER.size)
        got = reader.read_into(max(0, reader.size - FOOTER.size), [memoryview(tail)])
        return is_rank_file(bytes(tail[:got]))
    finally:
        reader.close()


def check_file(storage, name: str, filename: str, expected: dict | None) -> str | None:
    """Why `filename` of checkpoint `name` cannot be trusted, or None when it can."""
    key = f"{name}/{filename}"
    if not storage.exists(key):
        return f"{filename} is missing"
    if expected is not None and "index_sha256" in expected:
        return _check_indexed(storage, key, expected)
    if expected is None and _has_footer(storage, key):  # format 2 without a COMMIT record: its own checksums
        return _check_indexed(storage, key, None)
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
