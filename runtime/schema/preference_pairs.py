"""How a preference pair is tokenized and truncated, without numpy: the rules the alignment stage's dataset
(runtime/alignment/data.py, which stores the result as arrays) and a launch's check of small local files both run.

Each pair is two examples that share their first P tokens, the prompt: prompt + chosen and prompt + rejected,
rendered by the chat template and tokenized piece by piece as in SFT (chat.py). Truncation (NxD Training's
truncation_mode), prompt first, then the responses:
    P > max_prompt_length:  keep_start keeps the prompt's first max_prompt_length tokens;
                            keep_end refuses the pair by file:line (it never cuts a prompt)
    each response:          cut at its end so that prompt + response <= seq_length + 1 tokens
    a pair where either response has no loss token left is dropped; every pair dropped is an error
A pair whose chosen and rejected responses are the same messages teaches nothing (DPO's loss is ln 2 with no
gradient): model.data.identical_pairs (IDENTICAL_PAIRS) refuses such data by default, or drops them with a warning.

Counting tokens needs the `tokenizers` library, which is in pyproject's runtime extra, not in the launcher's core
dependencies: a launch checks prompt lengths where it is installed, and the job, which always has it, checks them
again before its first step.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import NamedTuple

from runtime.schema.chat import ChatTokenizer
from runtime.schema.choices import PROMPT_TRUNCATIONS
from runtime.schema.reader import Choices
from runtime.schema.records import LAUNCH_SCAN_BYTES, PreferenceRecord, read_preference_records

DEFAULT_LIMIT_KEY = "model_alignment_strategy.dpo.max_dpo_prompt_length"
# model.data.identical_pairs: what to do with pairs whose chosen equals rejected
IDENTICAL_PAIRS = Choices(("error", "drop"))
IDENTICAL_KEY = "model.data.identical_pairs"


class Limits(NamedTuple):
    seq_length: int
    max_prompt_length: int
    truncation_mode: str
    limit_key: str              # the config key of max_prompt_length, named in errors


class EncodedPairs(NamedTuple):
    """One chunk of pairs, tokenized and truncated; positions count from the chunk's first token and record."""
    tokens: list[int]           # each kept pair's prompt, chosen response and rejected response, back to back
    loss: list[int]             # their loss flags
    bounds: list[tuple[int, int, int, int]]  # per kept pair: start, prompt end, chosen end, rejected end
    kept: list[int]             # each kept pair's record number
    counts: list[int]           # dropped, truncated, prompts truncated
    identical: list[str]        # where each pair with chosen == rejected is (file:line); never kept


def check_limits(seq_length: int, max_prompt_length: int, truncation_mode: str, limit_key: str) -> Limits:
    mode_key = f"{limit_key.rpartition('.')[0]}.truncation_mode" if "." in limit_key else "truncation_mode"
    if problem := PROMPT_TRUNCATIONS.problem(mode_key, truncation_mode):
        raise ValueError(problem)
    if int(seq_length) < 1:
        raise ValueError(f"model.data.seq_length = {seq_length}; it must be a positive number of tokens")
    if int(max_prompt_length) < 1:
        raise ValueError(f"{limit_key} = {max_prompt_length}; it must be a positive number of tokens (below "
                         "model.data.seq_length, to leave room for the responses)")
    return Limits(int(seq_length), int(max_prompt_length), truncation_mode, limit_key)


def chunks(records: list[PreferenceRecord], num_workers: int) -> list[list[PreferenceRecord]]:
    """The records in the pieces they are encoded in (a worker's task); errors come chunk by chunk, so the launch
    check cuts them the same way to name the same first problem."""
    size = max(1, min(2048, math.ceil(len(records) / (4 * max(1, num_workers)))))
    return [records[i:i + size] for i in range(0, len(records), size)]


def encode_pairs(records: list[PreferenceRecord], limits: Limits, chat: ChatTokenizer) -> EncodedPairs:
    """Tokenize and truncate one chunk of pairs, in order."""
    where = [r.where for r in records for _ in range(2)]
    examples = chat.encode_examples([r.prompt + side for r in records for side in (r.chosen, r.rejected)], where)
    # The template's prompt with the generation header, tokenized as the pieces before the first response message
    # are: the shared prefix both examples must start with.
    prompts = chat.prompts_ids([r.prompt + r.chosen[:1] for r in records], where[::2])
    tokens: list[int] = []
    loss: list[int] = []
    bounds, kept, counts, identical = [], [], [0, 0, 0], []
    for number, record in enumerate(records):
        if record.chosen == record.rejected:
            identical.append(record.where)
            continue
        (chosen, chosen_mask), (rejected, rejected_mask) = examples[2 * number], examples[2 * number + 1]
        prompt = prompts[number]
        length = len(prompt)
        if chosen[:length] != prompt or rejected[:length] != prompt:
            raise ValueError(f"{record.where}: chat template {chat.name} does not render the prompt the same before "
                             "chosen and rejected, so the pair has no shared prompt; use a prefix-stable template")
        prompt_cut = length > limits.max_prompt_length
        if prompt_cut and limits.truncation_mode == "keep_end":
            raise ValueError(f"{record.where}: the prompt is {length} tokens, over {limits.limit_key}="
                             f"{limits.max_prompt_length}; truncation_mode keep_end never cuts a prompt (it keeps "
                             "the end next to the response whole): raise the limit, shorten the prompt or use "
                             "keep_start")
        prompt = prompt[:limits.max_prompt_length]
        room = max(0, limits.seq_length + 1 - len(prompt))
        responses = [(chosen[length:], chosen_mask[length:]), (rejected[length:], rejected_mask[length:])]
        cut = [(ids[:room], mask[:room]) for ids, mask in responses]
        if not all(any(mask) for _, mask in cut):  # the prompt's own tokens never carry loss
            counts[0] += 1
            continue
        counts[1] += prompt_cut or any(len(ids) > room for ids, _ in responses)
        counts[2] += prompt_cut
        start = len(tokens)
        tokens += prompt
        loss += [0] * len(prompt)
        for ids, mask in cut:
            tokens += ids
            loss += mask
        bounds.append((start, start + len(prompt), start + len(prompt) + len(cut[0][0]), len(tokens)))
        kept.append(number)
    return EncodedPairs(tokens, loss, bounds, kept, counts, identical)


def identical_pairs_problem(wheres: list[str]) -> str:
    """The one line that refuses preference data with pairs whose chosen equals rejected, naming the first file."""
    file = wheres[0].rsplit(":", 1)[0]
    in_file = sum(1 for where in wheres if where.rsplit(":", 1)[0] == file)
    elsewhere = f" ({len(wheres)} in all files)" if in_file < len(wheres) else ""
    return (f"{file}: {in_file} preference pairs have chosen equal to rejected{elsewhere}, the first at {wheres[0]}; "
            f"they teach nothing (DPO's loss stays ln 2 with no gradient): fix the data, or set "
            f"{IDENTICAL_KEY}=drop to drop them with a warning")


def every_pair_dropped(files: list[str], limits: Limits) -> str:
    return (f"every pair of {', '.join(files)} was dropped: none leaves a response token within "
            f"model.data.seq_length = {limits.seq_length} after a prompt of up to {limits.limit_key} = "
            f"{limits.max_prompt_length} tokens; raise model.data.seq_length or lower {limits.limit_key}")


def check_preference_file(path: str | os.PathLike, tokenizer_path: str | os.PathLike, chat_template: str | None,
                          seq_length: int, max_prompt_length: int, truncation_mode: str,
                          limit_key: str = DEFAULT_LIMIT_KEY) -> None:
    """The first problem of one file as a one-line ValueError (a bad record, a prompt over the limit under
    keep_end, no pair left after truncation), found as building the dataset from it with one worker would."""
    limits = check_limits(seq_length, max_prompt_length, truncation_mode, limit_key)
    chat = ChatTokenizer(tokenizer_path, chat_template)
    records = read_preference_records(path)
    kept = sum([len(encode_pairs(chunk, limits, chat).bounds) for chunk in chunks(records, 1)])  # every chunk
    if kept == 0:
        raise ValueError(every_pair_dropped([os.fspath(path)], limits))


def launch_problem(path: str, tokenizer_path: str, chat_template: str | None, seq_length: int,
                   max_prompt_length: int, truncation_mode: str, limit_key: str) -> str | None:
    """check_preference_file at launch, as one line: under keep_end, for a small local JSONL file, where the
    tokenizers library is installed (see above). Bigger files and parquet are checked by the job."""
    if path.endswith(".parquet") or not Path(path).is_file() or Path(path).stat().st_size > LAUNCH_SCAN_BYTES \
            or truncation_mode != "keep_end" or importlib.util.find_spec("tokenizers") is None:
        return None
    try:
        check_preference_file(path, tokenizer_path, chat_template, seq_length, max_prompt_length, truncation_mode,
                              limit_key)
    except ValueError as error:
        return " ".join(str(error).split())
    return None
