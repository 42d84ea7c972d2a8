"""A faster engine for GPT-2-style byte-level BPE tokenizers: the same tokenizer.json, run by tiktoken.

tiktoken's byte-pair encoder is several times faster per core than `tokenizers` for this one kind of model,
and for a byte-level BPE whose token ids follow its merge order (every BPE trainer's output, GPT-2's
vocabulary included) it produces the same ids. We use it only for tokenizer.json files of exactly that shape
(`ineligible` names the first reason not to), and keep checking: the worker re-encodes two documents of
every chunk with `tokenizers` (encode.py) and stops the stage if the two disagree. That is a spot check,
not a proof: `tokenizer.engine: huggingface` is the engine that is exact by definition.
"""
from __future__ import annotations

import importlib.util
import json
from typing import Any

# GPT-2's pre-tokenization regex, which `tokenizers`' ByteLevel(use_regex=True) also uses.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, as byte-level tokenizers store tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pre_tokenizer_ok(pre: Any) -> bool:
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        return len(steps) == 1 and _pre_tokenizer_ok(steps[0])
    return (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False))


def _merges(model: dict) -> list[tuple[str, str]]:
    # tokenizer.json stores merges as "a b" strings (older files) or [a, b] pairs (newer ones).
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def ineligible(spec: dict, add_special_tokens: bool) -> str | None:
    """Why this tokenizer.json cannot run on tiktoken, or None when it can."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") or \
            model.get("end_of_word_suffix"):
        return "its BPE uses dropout, byte fallback or subword affixes"
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    if not _pre_tokenizer_ok(spec.get("pre_tokenizer")):
        return "its pre-tokenizer is not GPT-2's byte-level one"
    if add_special_tokens and spec.get("post_processor") is not None:
        return "tokenizer.add_special_tokens with a post-processor"
    for token in spec.get("added_tokens", []):
        if not token.get("special") or token.get("normalized") or token.get("lstrip") or token.get("rstrip") \
                or token.get("single_word"):
            return f"added token {token.get('content')!r} has matching options tiktoken lacks"
    vocab: dict[str, int] = model.get("vocab", {})
    if any(ch not in vocab for ch in byte_to_char().values()):
        return "its vocabulary lacks some of the 256 byte tokens"
    previous = -1
    for left, right in _merges(model):
        merged = vocab.get(left + right)
        if merged is None or merged <= previous:
            return "its token ids do not follow the merge order"
        previous = merged
    if model.get("ignore_merges"):
        return "its BPE looks whole words up first (ignore_merges)"
    return None


def build_encoding(path: str):
    """The tokenizer.json at `path` as a tiktoken Encoding with identical ids."""
    import tiktoken

    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    char_to_byte = {c: b for b, c in byte_to_char().items()}
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab = spec["model"]["vocab"]
    # Only the 256 bytes and merge results: a vocabulary entry no merge makes (GPT-2's <|endoftext|>) is
    # never produced by BPE, so tiktoken must not find it either.
    reachable = set(byte_to_char().values()) | {left + right for left, right in _merges(spec["model"])}
    ranks = {bytes(char_to_byte[c] for c in token): vocab[token] for token in reachable}
    return tiktoken.Encoding("nxdt_data_prep", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


def available() -> bool:
    return importlib.util.find_spec("tiktoken") is not None
