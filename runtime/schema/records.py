"""The record files of fine-tuning and alignment (.jsonl, .jsonl.gz, .parquet), read and validated.

An SFT record is either `{"messages": [{"role": ..., "content": ...}, ...]}` or `{"prompt": ..., "completion": ...}`;
the second becomes a user message and an assistant message, so everything downstream sees one shape. A preference
record is {"prompt": ..., "chosen": ..., "rejected": ...}, all three required (TRL's implicit-prompt form, where
the prompt hides inside both responses, is refused: the shared prompt is what DPO compares the responses under).
Its prompt is a string (one user message) or a list of system/user/assistant messages ending with a user message;
chosen and rejected are each a string (one assistant message) or a list of assistant messages.

Every problem is a ValueError of one line that starts with where it is (`file:line` for JSON lines, `file:row N`
for parquet, 0-based as pyarrow counts) and ends with what to do about it. A .gz is read to its end-of-stream
marker before any record is returned: a truncated download must fail, not train on the half that arrived.

Part of the schema because a launch checks small local record files before anything is queued (launch_problem),
with the very functions the job reads them with: standard library only (pyarrow, for parquet, when it is read).
"""
from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from runtime.schema.choices import SFT_SUFFIXES

ROLES = ("system", "user", "assistant")
FILES_KEY = "model.data.train_ds.file_names"
KEYS = ("prompt", "chosen", "rejected")
SHAPE = '{"prompt": ..., "chosen": ..., "rejected": ...}'
# Records of smaller local JSONL files are checked at launch; the job checks all.
LAUNCH_SCAN_BYTES = 256 * 2**20

Message = dict[str, str]
T = TypeVar("T")


@dataclass(frozen=True)
class Record:
    where: str                  # "file:line" (JSON lines) or "file:row N" (parquet), for error messages
    messages: list[Message]


@dataclass(frozen=True)
class PreferenceRecord:
    where: str                  # "file:line" (JSON lines) or "file:row N" (parquet), for error messages
    prompt: list[Message]       # ends with a user message
    chosen: list[Message]       # assistant messages only
    rejected: list[Message]


def read_records(path: str | os.PathLike) -> list[Record]:
    """Every record of one file, validated; a file without records is an error."""
    return read_with(path, lambda value, where: Record(where, to_messages(value, where)))


def read_with(path: str | os.PathLike, convert: Callable[[Any, str], T], what: str = "SFT") -> list[T]:
    """convert(parsed value, where) for every record of one file, in order: the reading, the errors and the gzip
    check of read_records for other record shapes (preference pairs). `what` names the inputs in errors."""
    path = os.fspath(path)
    if path.endswith(".parquet"):
        values = _parquet_records(path, convert)
    elif path.endswith((".jsonl", ".jsonl.gz")):
        values = _jsonl_records(path, convert)
    else:
        raise ValueError(f"{path}: unknown input format; {what} inputs end in {', '.join(SFT_SUFFIXES)}")
    if not values:
        raise ValueError(f"{path}: the file holds no records; remove it from the inputs or write records into it")
    return values


def read_all(paths: list[str | os.PathLike]) -> list[Record]:
    """The records of every file, files in the order given."""
    if not paths:
        raise ValueError(f"no SFT input files; list them in {FILES_KEY} ({', '.join(SFT_SUFFIXES)})")
    return [record for path in paths for record in read_records(path)]


def to_messages(value: Any, where: str) -> list[Message]:
    """One record as a list of messages: checked roles, string contents, at least one assistant turn."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a record must be a JSON object, not {type(value).__name__}; write "
                         '{"messages": [...]} or {"prompt": ..., "completion": ...}')
    if "messages" in value:
        messages = value["messages"]
    elif "prompt" in value and "completion" in value:
        messages = [{"role": "user", "content": value["prompt"]},
                    {"role": "assistant", "content": value["completion"]}]
    else:
        raise ValueError(f"{where}: the record has keys {sorted(value)}; it needs \"messages\" or both "
                         "\"prompt\" and \"completion\"")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    checked = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {number} is {type(message).__name__}, not an object; write "
                             '{"role": ..., "content": ...}')
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: message {number} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {number} ({role}) has content of type {type(content).__name__}; "
                             "content must be a string")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError(f"{where}: the record has no assistant message, so nothing to learn from; add one or "
                         "remove the record")
    return checked


def launch_problem(path: str, key: str, pairs: bool = False) -> str | None:
    """The first malformed record of a local JSONL file (no assistant turn, an unknown role, bad JSON; a pair
    without chosen), named by file:line before anything is queued. Bigger files and parquet are read by the job,
    before its first step."""
    if path.endswith(".parquet") or os.stat(path).st_size > LAUNCH_SCAN_BYTES:
        return None
    try:
        (read_preference_records if pairs else read_records)(path)
    except ValueError as error:
        return f"{key}: {' '.join(str(error).split())}"
    return None


def read_preference_records(path: str | os.PathLike) -> list[PreferenceRecord]:
    """Every pair of one file, validated; a file without records is an error."""
    return read_with(path, to_preference, what="preference")


def read_all_preferences(paths: list[str | os.PathLike]) -> list[PreferenceRecord]:
    """The pairs of every file, files in the order given."""
    if not paths:
        raise ValueError(f"no preference files; list them in {FILES_KEY} ({', '.join(SFT_SUFFIXES)})")
    return [record for path in paths for record in read_preference_records(path)]


def to_preference(value: Any, where: str) -> PreferenceRecord:
    """One parsed record as a PreferenceRecord, or a one-line ValueError starting with `where`."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a record must be a JSON object, not {type(value).__name__}; write {SHAPE}")
    missing = [key for key in KEYS if key not in value]
    if missing:
        raise ValueError(f"{where}: the record has no {missing[0]!r} (keys: {', '.join(sorted(value)) or 'none'}); "
                         f"a preference pair is {SHAPE}")
    prompt = _messages(value["prompt"], where, "prompt", "user")
    if prompt[-1]["role"] != "user":
        raise ValueError(f"{where}: the prompt ends with a {prompt[-1]['role']} message; it must end with the user "
                         "message the responses answer (move a final assistant turn into chosen and rejected)")
    chosen, rejected = (_messages(value[key], where, key, "assistant") for key in ("chosen", "rejected"))
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        if any(m["role"] != "assistant" for m in messages):
            role = next(m["role"] for m in messages if m["role"] != "assistant")
            raise ValueError(f"{where}: {key} holds a {role} message; a response is assistant messages only (put "
                             "the conversation before it in prompt)")
        if not any(m["content"].strip() for m in messages):
            raise ValueError(f"{where}: {key} is empty; give it the response text or remove the record")
    return PreferenceRecord(where, prompt, chosen, rejected)


def _messages(value: Any, where: str, key: str, role: str) -> list[Message]:
    """A string as one message of `role`, or a checked non-empty list of {"role", "content"} messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: {key} is empty; give it the text or remove the record")
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key} is {_describe(value)}; write a string or a non-empty list of "
                         '{"role": ..., "content": ...} messages')
    checked = []
    for number, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {key} message {number} is {type(message).__name__}, not an object; write "
                             '{"role": ..., "content": ...}')
        message_role, content = message.get("role"), message.get("content")
        if message_role not in ROLES:
            raise ValueError(f"{where}: {key} message {number} has role {message_role!r}; use one of "
                             f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: {key} message {number} ({message_role}) has content of type "
                             f"{type(content).__name__}; content must be a string")
        checked.append({"role": message_role, "content": content})
    return checked


def _describe(value: Any) -> str:
    return "an empty list" if value == [] else f"of type {type(value).__name__}"

def _jsonl_records(path: str, convert: Callable[[Any, str], T]) -> list[T]:
    values = []
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as lines:
            try:
                for number, line in enumerate(lines, start=1):
                    if not line.strip():
                        continue  # blank lines (a trailing newline pair, say) are no records
                    where = f"{path}:{number}"
                    try:
                        value = json.loads(line)
                    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError both
                        raise ValueError(f"{where}: not valid JSON ({_first_line(err)}); fix or remove the "
                                         "line") from None
                    values.append(convert(value, where))
            except ValueError:
                # Damaged gzip data first shows as a garbled line; read to the end (the CRC) before blaming it.
                while path.endswith(".gz") and lines.read(1 << 20):
                    pass
                raise
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        # EOFError: the stream stops before gzip's end marker; the others: damaged bytes or a failed CRC.
        raise ValueError(f"{path}: truncated or corrupt gzip ({_first_line(err)}); fetch or write the file "
                         "again") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err}); check the path in the inputs") from None
    return values


def _parquet_records(path: str, convert: Callable[[Any, str], T]) -> list[T]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ValueError(f"{path}: reading .parquet needs pyarrow; pip install 'nxdt-launch[parquet]'") from None
    try:
        rows = parquet.read_table(path).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise ValueError(f"{path}: not a readable parquet file ({_first_line(err)}); fetch or write the file "
                         "again") from None
    return [convert(_drop_nulls(row), f"{path}:row {index}") for index, row in enumerate(rows)]


def _drop_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """A table with both layouts has nulls in the columns a row does not use; a null is an absent key."""
    return {key: value for key, value in row.items() if value is not None}


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
