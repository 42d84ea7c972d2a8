"""File publishing that stays correct when array tasks on several nodes share one filesystem.

Nothing is ever written in place: outputs go to a name unique to this process, then appear under their final
name in one atomic step. `publish_first` keeps whichever copy landed first, so two tasks that produced the
same file (a tokenizer, say) can never swap it under a third task that already started using it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any


def temp_name(path: str | os.PathLike) -> Path:
    """A sibling name no other process uses; `is_temp` recognizes it for cleanup."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def is_temp(name: str) -> bool:
    return ".tmp-" in name


# A write refused for want of room: a full disk, a full quota, or a file-size limit (RLIMIT_FSIZE, a file
# system's largest file). Each is reported alike (no_room_line), after the writer removed what it had begun.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in NO_ROOM


def no_room_line(error: OSError, key: str, where: str | os.PathLike) -> str:
    """One line for a write with no room under `where` (the directory `key` names): what ran out, that nothing
    half-written was kept, and the fix."""
    return (f"{key} {str(where)!r}: no room to write ({error.strerror or os.strerror(error.errno)}); nothing "
            f"half-written was kept: free space there (or raise the quota or file-size limit), or set {key} to a "
            f"disk with room, then run it again")


def write_temp(path: str | os.PathLike, data: bytes) -> Path:
    """`data` in a new file under `path`'s temp_name, flushed to disk; removed again if the write fails (a full
    disk), so that no half-written file is left."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Readers see the old file or the new one, never half of one (rename is atomic within a filesystem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(write_temp(path, data), path)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def publish_first(tmp: str | os.PathLike, final: str | os.PathLike) -> bool:
    """Moves `tmp` to `final` unless `final` exists. True when ours became `final`.

    A hard link fails when the target exists, which makes "create if absent" atomic; on filesystems without
    hard links we fall back to check-then-rename, whose window only matters if two tasks finish together.
    """
    tmp, final = Path(tmp), Path(final)
    try:
        os.link(tmp, final)
    except FileExistsError:
        tmp.unlink()
        return False
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if final.exists():
            tmp.unlink()
            return False
        os.replace(tmp, final)
        return True
    tmp.unlink()
    return True


def publish_first_bytes(data: bytes, final: str | os.PathLike) -> bool:
    """publish_first of `data`, written under a temp name that a failed write does not leave behind."""
    return publish_first(write_temp(final, data), final)


def replace_directory(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Replace the directory `out` by `tmp`; an old non-empty `out` is moved aside first and deleted after.

    A crash between the two renames leaves the old directory under .<name>.old-*, never a mix of old and new.
    """
    tmp, out = Path(tmp), Path(out)
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)  # rename(2) may replace an empty directory
    if old is not None:
        shutil.rmtree(old)


def sha256_file(path_or_file) -> str:
    """Hex SHA-256 of a file, given by path or as a binary file open at its start (read to its end)."""
    if hasattr(path_or_file, "read"):
        return hashlib.file_digest(path_or_file, "sha256").hexdigest()  # releases the GIL while it hashes
    with open(path_or_file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_json(path: str | os.PathLike) -> Any | None:
    """The parsed file, or None when it is missing or unreadable (a crash never leaves half of one)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def remove_temps(directory: str | os.PathLike, stem: str) -> list[str]:
    """Deletes leftovers of killed writers (`<stem>*.tmp-*`). Only the task that owns `stem` calls this."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if entry.name.startswith(stem) and is_temp(entry.name):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines text (metrics.jsonl): a line a running writer has not finished, or any other
    line that is not an object, is left out."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
