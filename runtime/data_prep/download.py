"""Resumable HTTP(S) download with retries and checksum verification; runs inside the job, never at render time.

Bytes land in `<dest>.part`; after an interruption the next attempt (or the next run) asks for the rest with
a Range request, so a 40 GB Pile shard is never fetched twice. A server that ignores Range (200 instead of
206) restarts the file from zero. The finished file is checked against its checksum, if one is known, before
it is renamed into place: a file under its final name is always complete.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from runtime.schema.data_preparation import DataError, UserError
from runtime.io.files import temp_name

# Worth retrying: the server or the path to it may recover. Other 4xx answers will not change.
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
_BLOCK = 1 << 20


class _Incomplete(Exception):
    pass


def parse_checksum(value: str, where: str) -> tuple[str, str]:
    """"sha256:<hex>", "md5:<hex>" or bare hex (64 digits: sha256, 32: md5) -> (algorithm, hex)."""
    value = value.strip().lower()
    algorithm, _, digest = value.rpartition(":")
    if not algorithm:
        algorithm = {64: "sha256", 32: "md5"}.get(len(digest), "")
    if algorithm not in ("sha256", "md5") or not re.fullmatch(r"[0-9a-f]+", digest):
        raise UserError(f"{where} = {value!r}: expected sha256:<64 hex digits> or md5:<32 hex digits>")
    return algorithm, digest


def load_checksums(checksums: Mapping[str, str] | str | None) -> dict[str, str]:
    """{file name: checksum} from the config mapping or a `sha256sum`-style file ("<hex>  <name>" lines)."""
    if checksums is None:
        return {}
    if isinstance(checksums, Mapping):
        return {str(k): str(v) for k, v in checksums.items()}
    table = {}
    with open(checksums, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and not line.startswith("#"):
                table[os.path.basename(parts[-1].lstrip("*"))] = parts[0]
    return table


def file_digest(path: str | os.PathLike, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, dest: str | os.PathLike, *, checksum: str | None = None, retries: int = 5,
             timeout_s: float = 60.0, backoff_s: float = 2.0, resume: bool = True,
             log: Callable[[str], None] = print) -> Path:
    """Fetches `url` to `dest` (skipped if `dest` is already there and matches `checksum`).

    `resume=False` writes to a name private to this process: for small files that every task fetches at once.
    """
    dest = Path(dest)
    expected = parse_checksum(checksum, f"the checksum of {dest.name}") if checksum else None
    if dest.exists():
        if expected is None or file_digest(dest, expected[0]) == expected[1]:
            return dest
        log(f"{dest}: checksum mismatch; downloading it again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part") if resume else temp_name(dest)
    try:
        _download_to(url, part, expected, retries=retries, timeout_s=timeout_s, backoff_s=backoff_s, log=log)
    except BaseException:
        if not resume:           # a private name is never resumed: don't leave it behind
            part.unlink(missing_ok=True)
        raise
    os.replace(part, dest)
    return dest


def _download_to(url: str, part: Path, expected: tuple[str, str] | None, *, retries: int, timeout_s: float,
                 backoff_s: float, log: Callable[[str], None]) -> None:
    for fresh_start in (False, True):
        if fresh_start:
            part.unlink(missing_ok=True)
        _fetch(url, part, retries=retries, timeout_s=timeout_s, backoff_s=backoff_s, log=log)
        if expected is None:
            break
        actual = file_digest(part, expected[0])
        if actual == expected[1]:
            break
        # A resumed file can splice two versions of a file that changed on the server; try once from zero.
        log(f"{url}: {expected[0]} {actual} does not match the expected {expected[1]}")
        if fresh_start:
            part.unlink(missing_ok=True)
            raise DataError(f"{url}: checksum mismatch after a fresh download (got {expected[0]}:{actual}); "
                            "check download.checksums or the URL")


def _fetch(url: str, part: Path, *, retries: int, timeout_s: float, backoff_s: float,
           log: Callable[[str], None]) -> None:
    for attempt in range(retries + 1):
        try:
            _attempt(url, part, timeout_s, log)
            return
        except urllib.error.HTTPError as err:
            if err.code not in _RETRY_STATUS:
                raise DataError(f"{url}: HTTP {err.code} {err.reason}; check the URL") from None
            problem = f"HTTP {err.code}"
        except (_Incomplete, urllib.error.URLError, http.client.HTTPException, OSError) as err:
            problem = f"{type(err).__name__}: {err}"
        if attempt == retries:
            raise DataError(f"{url}: download failed after {retries + 1} attempts ({problem}); rerun to resume "
                            f"from {part.stat().st_size if part.exists() else 0} bytes, or raise download.retries")
        wait = backoff_s * 2 ** attempt
        log(f"{url}: {problem}; retrying in {wait:.0f}s ({attempt + 1}/{retries})")
        time.sleep(wait)


def _attempt(url: str, part: Path, timeout_s: float, log: Callable[[str], None]) -> None:
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "nxdt-launch data_prep"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as err:
        if err.code != 416 or not offset:
            raise
        # "Range not satisfiable": we already hold every byte, or the file shrank on the server.
        total = _total_from_content_range(err.headers.get("Content-Range", ""))
        if total == offset:
            return
        part.unlink()
        raise _Incomplete(f"the server's file ({total} bytes) is smaller than our partial copy") from None
    with response:
        if response.status == 206:
            start = _start_from_content_range(response.headers.get("Content-Range", ""))
            if start != offset:
                part.unlink()
                raise _Incomplete(f"asked for bytes from {offset}, the server sent from {start}")
            total = _total_from_content_range(response.headers.get("Content-Range", ""))
            mode = "ab"
        else:
            if offset:
                log(f"{url}: the server ignored the Range request; starting over")
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            mode, offset = "wb", 0
        with open(part, mode) as f:
            while block := response.read(_BLOCK):
                f.write(block)
    size = part.stat().st_size
    if total is not None and size != total:
        raise _Incomplete(f"the connection closed at {size} of {total} bytes")


def _start_from_content_range(value: str) -> int | None:
    match = re.match(r"bytes\s+(\d+)-\d+/", value)
    return int(match.group(1)) if match else None


def _total_from_content_range(value: str) -> int | None:
    match = re.search(r"/(\d+)\s*$", value)
    return int(match.group(1)) if match else None
