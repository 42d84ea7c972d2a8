"""Reading preference pairs from .jsonl, .jsonl.gz and .parquet files, validated, in one chat shape.

A record is {"prompt": ..., "chosen": ..., "rejected": ...}, all three required (TRL's implicit-prompt form, where
the prompt hides inside both responses, is refused: the shared prompt is what DPO compares the responses under).
prompt is a string (one user message) or a list of system/user/assistant messages ending with a user message;
chosen and rejected are each a string (one assistant message) or a list of assistant messages.

File reading, the gzip end-of-stream check and the one-line `file:line: problem; fix` errors are runtime/sft's
(read_with); this module only checks the record's shape. Standard library only (pyarrow for parquet): the
launcher's schema reads records at launch, where torch, numpy and tokenizers may be missing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runtime.schema.choices import SFT_SUFFIXES
from runtime.sft.records import ROLES, Message, read_with

FILES_KEY = "model.data.train_ds.file_names"
KEYS = ("prompt", "chosen", "rejected")
SHAPE = '{"prompt": ..., "chosen": ..., "rejected": ...}'


@dataclass(frozen=True)
class PreferenceRecord:
    where: str                  # "file:line" (JSON lines) or "file:row N" (parquet), for error messages
    prompt: list[Message]       # ends with a user message
    chosen: list[Message]       # assistant messages only
    rejected: list[Message]


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
