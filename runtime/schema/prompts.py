"""What the rl stage reads that a launch checks before anything is queued: its prompt records ({"prompt", "answer"},
read_prompts) and its reward, a function named by a dotted path (load_reward). Part of the schema so the launch and
the job check them with the same functions (runtime/rl/data.py and runtime/rl/rewards.py use these); standard
library only, besides the user's own reward module, which load_reward imports.

A prompt is a string (one user message) or a list of system/user/assistant messages ending with a user message, as
a preference pair's prompt (runtime/schema/records.py). The answer is what the reward compares a completion with; a
reward that needs none (needs_answer False) gets "" for a record without one.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from runtime.schema.records import Message, _messages, read_with

SHAPE = '{"prompt": ..., "answer": ...}'
FILES_KEY = "rl.data.train_files"
Reward = Callable[[str, str], float]


@dataclass(frozen=True)
class PromptRecord:
    where: str                  # "file:line" (JSON lines) or "file:row N" (parquet), for error messages
    prompt: list[Message]       # ends with a user message
    answer: str


def to_prompt_record(value: Any, where: str, needs_answer: bool = True) -> PromptRecord:
    """One parsed record as a PromptRecord, or a one-line ValueError starting with `where`."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a record must be a JSON object, not {type(value).__name__}; write {SHAPE}")
    if "prompt" not in value:
        raise ValueError(f"{where}: the record has no 'prompt' (keys: {', '.join(sorted(value)) or 'none'}); "
                         f"a prompt record is {SHAPE}")
    prompt = _messages(value["prompt"], where, "prompt", "user")
    if prompt[-1]["role"] != "user":
        raise ValueError(f"{where}: the prompt ends with a {prompt[-1]['role']} message; it must end with the user "
                         "message the completion answers")
    if "answer" not in value:
        if needs_answer:
            raise ValueError(f"{where}: the record has no 'answer' (keys: {', '.join(sorted(value))}), which the "
                             f"reward compares completions with; add one ({SHAPE}) or remove the record")
        return PromptRecord(where, prompt, "")
    answer = value["answer"]
    if not isinstance(answer, str):
        raise ValueError(f"{where}: 'answer' is of type {type(answer).__name__}; write it as a string "
                         f"(\"answer\": \"{answer}\")")
    return PromptRecord(where, prompt, answer)


def read_prompts(paths: Sequence[str | os.PathLike], needs_answer: bool = True,
                 key: str = FILES_KEY) -> list[PromptRecord]:
    """The records of every file, files in the order given; `key` names the setting in the error for none."""
    if not paths:
        raise ValueError(f"{key}: no prompt files; list .jsonl, .jsonl.gz or .parquet files of {SHAPE}")
    return [record for path in paths
            for record in read_with(path, lambda value, where: to_prompt_record(value, where, needs_answer),
                                    what="prompt")]


def load_reward(path: str) -> Reward:
    """The function at `path`: 'module:name' or 'module.name'. ValueError, one line naming the path, when it cannot
    be imported or is not callable."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"reward: {path!r} is not a dotted path; write 'module:function', e.g. "
                         "'runtime.rl.rewards:exact_match'")
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"reward: {path!r} names no function; write 'module:function', e.g. "
                         "'runtime.rl.rewards:exact_match'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a user's module failing as it imports is the same mistake as a missing one
        raise ValueError(f"reward: {path!r}: cannot import {module_name} ({one_line(error)})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward: {path!r}: {module_name} has no function {name!r}")
    return function


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
