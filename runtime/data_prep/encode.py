"""The tokenizer worker: a chunk of raw input in, token ids as flat numpy arrays out.

Each worker process parses JSON and tokenizes a whole chunk with one batch call into the tokenizer's native
code (HF `encode_batch_fast`, which skips character offsets we would throw away, or SentencePiece's batch
`encode`). Results go back as two numpy arrays rather than lists of Python ints, which keeps the parent's
share of the work to writing bytes. Workers run one tokenizer thread each: parallelism comes from the
processes, and a Rust thread pool per process would only fight them for the same cores.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from runtime.data_prep.readers import Chunk


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a worker needs to tokenize exactly as every other worker does (it is pickled to them)."""

    library: str               # huggingface | sentencepiece
    path: str                  # the tokenizer.json or SentencePiece .model that encodes
    vocab_size: int
    eod_id: int | None         # appended to every document when not None
    add_special_tokens: bool
    dtype: str                 # numpy dtype of the token ids on disk
    text_key: str
    engine: str = "huggingface"   # huggingface | tiktoken (same ids, faster: fast_bpe.py) | sentencepiece


@dataclass
class EncodedChunk:
    tokens: np.ndarray
    lengths: np.ndarray        # int32 tokens per document (eod included)
    documents: int = 0
    empty: int = 0
    text_bytes: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)   # (line number, why)


def load_encoder(spec: EncoderSpec, threads: int = 1) -> Callable[[list[str]], list[list[int]]]:
    """A function from a batch of texts to their token id lists."""
    if spec.library == "sentencepiece":
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=spec.path)

        def encode_spm(texts: list[str]) -> list[list[int]]:
            return processor.encode(texts, out_type=int, add_bos=spec.add_special_tokens, num_threads=threads)

        return encode_spm
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(spec.path)
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)   # _fast: tokenizers >= 0.21

    def encode_hf(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in batch(texts, add_special_tokens=spec.add_special_tokens)]

    if spec.engine != "tiktoken":
        return encode_hf
    from runtime.data_prep.fast_bpe import build_encoding

    encoding = build_encoding(spec.path)

    def encode_tiktoken(texts: list[str]) -> list[list[int]]:
        ids = [encoding.encode(text, allowed_special="all") for text in texts]
        if not texts:
            return ids
        # The guard that makes this engine safe to use: per batch, the first document and the one with the
        # most non-ASCII text (where the two libraries' Unicode tables could differ) re-encoded the
        # reference way.
        wide = max(range(len(texts)), key=lambda i: len(texts[i].encode()) - len(texts[i]))
        for i in sorted({0, wide}):
            if ids[i] != encode_hf([texts[i]])[0]:
                raise EngineMismatch(f"{i}:{texts[i][:80]!r}")
        return ids

    return encode_tiktoken


class EngineMismatch(Exception):
    """tiktoken and `tokenizers` disagreed on a document (its start is the message)."""


_worker: tuple[EncoderSpec, Callable[[list[str]], list[list[int]]]] | None = None


def init_worker(spec: EncoderSpec) -> None:
    """Pool initializer. The thread settings must precede the first tokenizer call to take effect."""
    global _worker
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (spec, load_encoder(spec))


def _text_of(record: Any, key: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, why the record is unusable)."""
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    if key not in record:
        return None, f"no {key!r} key (input.text_key); keys are {', '.join(list(record)[:8])}"
    text = record[key]
    if not isinstance(text, str):
        return None, f"{key!r} holds {type(text).__name__}, not a string"
    return text, None


def encode_chunk(chunk: Chunk) -> EncodedChunk:
    assert _worker is not None, "init_worker was not called"
    spec, encoder = _worker
    return encode_with(chunk, spec, encoder)


def encode_with(chunk: Chunk, spec: EncoderSpec, encoder: Callable[[list[str]], list[list[int]]]) -> EncodedChunk:
    texts: list[str] = []
    numbers: list[int] = []
    empty = 0
    bad: list[tuple[int, str]] = []

    def take(number: int, text: str | None, why: str | None) -> None:
        nonlocal empty
        if why is not None:
            bad.append((number, why))
        elif not text or text.isspace():
            empty += 1
        else:
            texts.append(text)
            numbers.append(number)

    # Records longer than input.max_record_mb: the reader left their places empty and shard.py reports them.
    left_out = {number for number, _ in chunk.too_long}
    if chunk.kind in ("lines", "values"):
        lines = chunk.kind == "lines"
        items = chunk.payload.split(b"\n") if lines else chunk.payload
        text_bytes = len(chunk.payload) if lines else sum(len(item) for item in items)
        for number, item in enumerate(items, chunk.first_line):
            if number in left_out or (lines and not item.strip()):
                continue                     # blank lines separate nothing in JSON lines; not an error
            try:
                record = json.loads(item)
            except ValueError as err:        # includes invalid UTF-8 (UnicodeDecodeError)
                bad.append((number, f"malformed JSON ({err})"))
                continue
            take(number, *_text_of(record, spec.text_key))
    else:
        text_bytes = sum(len(t or "") for t in chunk.payload)
        for number, text in enumerate(chunk.payload, chunk.first_line):
            if number not in left_out:
                take(number, text, None)

    ids = _encode_all(texts, numbers, encoder, bad)
    if spec.eod_id is not None:
        for doc in ids:
            doc.append(spec.eod_id)
    lengths = np.fromiter((len(doc) for doc in ids), dtype=np.int32, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.dtype(spec.dtype), count=int(lengths.sum()))
    bad.sort()
    return EncodedChunk(tokens, lengths, len(ids), empty, text_bytes, bad)


def _encode_all(texts: list[str], numbers: list[int], encoder, bad: list[tuple[int, str]]) -> list[list[int]]:
    """One batch call; if the batch fails (a lone surrogate, say), find the culprits one by one."""
    try:
        return encoder(texts)
    except EngineMismatch as err:
        index, _, start = str(err).partition(":")
        raise EngineMismatch(f"line {numbers[int(index)]} ({start})") from None
    except Exception:
        pass
    ids = []
    for number, text in zip(numbers, texts):
        try:
            ids.extend(encoder([text]))
        except Exception as err:
            bad.append((number, f"the tokenizer rejected the text ({type(err).__name__}: {err})"))
    return ids
