"""One shard: input file -> `<prefix>.bin` + `<prefix>.idx` + `summaries/<shard>.json`, all or nothing.

The reading process cuts the input into chunks and keeps at most two per worker in flight (so memory stays
bounded however big the file is); results are written strictly in input order, so the output does not depend
on the number of workers. Output goes to temporary names; the summary is written last, after both renames,
and is the only mark of completion: a shard counts as done when its summary exists, describes the same input,
tokenizer and settings (the fingerprint), and matches the files' sizes. A killed run therefore leaves nothing
that a rerun could mistake for finished work.
"""
from __future__ import annotations

import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from runtime.schema.data_preparation import DataError, StageConfig
from runtime.data_prep.demo import write_demo_shard
from runtime.data_prep.download import download, load_checksums
from runtime.data_prep.encode import EncodedChunk, EncoderSpec, EngineMismatch, encode_chunk
from runtime.io.files import atomic_write_json, read_json, remove_temps, temp_name
from runtime.data_prep.indexed import IndexedDatasetWriter
from runtime.data_prep.plan import Shard, url_basename
from runtime.data_prep.progress import Reporter
from runtime.data_prep.readers import iter_chunks
from runtime.workers import OrderedPool, WorkerDied

_EXAMPLES = 10          # bad lines quoted in the log and the summary, per shard


def summary_path(cfg: StageConfig, shard: Shard) -> Path:
    return Path(cfg.output_dir) / "summaries" / f"{shard.name}.json"


def fingerprint(cfg: StageConfig, shard: Shard, spec: EncoderSpec, tokenizer_sha256: str) -> dict[str, Any]:
    """Everything the shard's tokens depend on. URLs are identified by the URL (the download may be gone)."""
    identity: dict[str, Any] = {"location": shard.location}
    if not shard.is_url:
        path = shard.local_path(cfg)
        identity["size"] = os.path.getsize(path) if os.path.exists(path) else None
    return {"format": 1, "input": identity, "text_key": cfg.input.text_key, "dtype": spec.dtype,
            "eod_id": spec.eod_id, "add_special_tokens": spec.add_special_tokens,
            "tokenizer_sha256": tokenizer_sha256, "max_record_bytes": max_record_bytes(cfg)}


def max_record_bytes(cfg: StageConfig) -> int:
    return int(cfg.input.max_record_mb * 1e6)


def done_summary(cfg: StageConfig, shard: Shard, expected: dict[str, Any]) -> dict[str, Any] | None:
    summary = read_json(summary_path(cfg, shard))
    if not summary or summary.get("fingerprint") != expected:
        return None
    prefix = shard.prefix(cfg)
    for suffix, key in ((".bin", "bin_bytes"), (".idx", "idx_bytes")):
        if not os.path.exists(prefix + suffix) or os.path.getsize(prefix + suffix) != summary.get(key):
            return None
    return summary


def ensure_input(cfg: StageConfig, shard: Shard, log) -> str:
    """The local file to read: generated for the demo, downloaded (resuming) for a URL."""
    path = shard.local_path(cfg)
    if cfg.input.source == "demo":
        write_demo_shard(path, shard.index, cfg.demo.num_shards, cfg.demo.max_mb, cfg.input.text_key)
    elif shard.is_url and not os.path.exists(path):
        checksum = load_checksums(cfg.download.checksums).get(url_basename(shard.location))
        log(f"{shard.name}: downloading {shard.location}")
        download(shard.location, path, checksum=checksum, retries=cfg.download.retries,
                 timeout_s=cfg.download.timeout_s, backoff_s=cfg.download.backoff_s, log=log)
    return path


class _Tally:
    def __init__(self) -> None:
        self.documents = self.tokens = self.text_bytes = self.empty = self.bad = self.too_long = 0
        self.examples: list[str] = []
        self.too_long_examples: list[str] = []


def process_shard(cfg: StageConfig, shard: Shard, spec: EncoderSpec, expected: dict[str, Any],
                  pool: OrderedPool, reporter: Reporter) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    removed = remove_temps(out, f"{shard.name}_text_document.")
    if removed:
        reporter.log(f"{shard.name}: removed {len(removed)} partial files of an interrupted run")
    path = ensure_input(cfg, shard, reporter.log)
    prefix = shard.prefix(cfg)
    tmp_bin, tmp_idx = temp_name(prefix + ".bin"), temp_name(prefix + ".idx")
    writer = IndexedDatasetWriter(tmp_bin, tmp_idx, np.dtype(spec.dtype))
    tally, started, wall_started = _Tally(), time.monotonic(), time.time()
    reporter.start(shard.name, os.path.getsize(path))
    pending: deque = deque()  # (position, records too long) of each chunk sent and not yet taken back

    def chunks():
        for chunk in iter_chunks(path, cfg.input.text_key, int(cfg.chunk_mb * 1e6), max_record_bytes(cfg)):
            pending.append((chunk.position, chunk.too_long))
            yield (chunk,)

    try:
        # The reader raises DataError if the input ends early (a truncated .gz or .zst), after the chunks before
        # it were encoded: the except clauses below then discard everything, and no summary is written.
        for result in pool.map(encode_chunk, chunks(), ahead=2):
            _take(cfg, path, writer, tally, reporter, result, *pending.popleft())
        if tally.documents == 0:
            raise DataError(f"{path}: no tokens written ({tally.bad} bad lines, {tally.empty} empty documents, "
                            f"{tally.too_long} records over input.max_record_mb; text key {cfg.input.text_key!r}); "
                            "the shard is not marked complete")
        bin_bytes, idx_bytes = writer.finish()
    except EngineMismatch as err:
        _discard(writer, tmp_bin, tmp_idx)
        raise DataError(f"{path}: tiktoken and tokenizers disagree at {err}; set tokenizer.engine: huggingface "
                        "and rerun") from None
    except WorkerDied as err:
        _discard(writer, tmp_bin, tmp_idx)
        raise DataError(f"a tokenizer worker died while encoding {path}: {err}; rerun to redo this shard, with "
                        "fewer workers_per_node if memory is short (the OOM killer sends SIGKILL)") from None
    except BaseException:
        _discard(writer, tmp_bin, tmp_idx)
        raise
    reporter.finish()
    # .bin and .idx first, the summary last: the summary is what says "done".
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")
    seconds = time.monotonic() - started
    summary = {"shard": shard.name, "input": shard.location, "prefix": prefix, "documents": tally.documents,
               "tokens": tally.tokens, "text_bytes": tally.text_bytes, "skipped_lines": tally.bad,
               "empty_documents": tally.empty, "bad_line_examples": tally.examples,
               "long_records": tally.too_long, "long_record_examples": tally.too_long_examples,
               "seconds": round(seconds, 3),
               "started_at": wall_started, "finished_at": time.time(), "host": socket.gethostname(),
               "bin_bytes": bin_bytes, "idx_bytes": idx_bytes, "dtype": spec.dtype, "vocab_size": spec.vocab_size,
               "engine": spec.engine,
               "fingerprint": expected}
    atomic_write_json(summary_path(cfg, shard), summary)
    reporter.log(f"{shard.name}: {tally.documents:,} documents, {tally.tokens:,} tokens, "
                 f"{tally.text_bytes / 1e6:,.1f} MB in {seconds:.1f}s ({tally.text_bytes / 1e6 / seconds:,.1f} MB/s, "
                 f"{tally.tokens / seconds:,.0f} tok/s); skipped {tally.bad} bad lines, {tally.too_long} long "
                 f"records, {tally.empty} empty documents")
    if shard.is_url and cfg.download.remove_after_preprocess:
        os.unlink(path)
    return summary


def _take(cfg: StageConfig, path: str, writer: IndexedDatasetWriter, tally: _Tally, reporter: Reporter,
          result: EncodedChunk, position: int, too_long: list[tuple[int, int]]) -> None:
    """One encoded chunk, in input order: its records too long and bad lines skipped (or failed on, as the
    config says), its documents appended to the shard, its counts added to the tally and the progress."""
    for number, size in too_long:
        where = (f"{path}:{number}: a record of {size:,} bytes, longer than input.max_record_mb "
                 f"({cfg.input.max_record_mb:g} MB)")
        if cfg.input.on_long_record == "fail":
            raise DataError(f"{where}; raise input.max_record_mb or set input.on_long_record: skip to skip "
                            "such records")
        tally.too_long += 1
        if len(tally.too_long_examples) < _EXAMPLES:
            tally.too_long_examples.append(where)
            reporter.log(f"skipped {where}")
    writer.add_documents(result.tokens, result.lengths)
    tally.documents += result.documents
    tally.tokens += int(result.tokens.size)
    tally.text_bytes += result.text_bytes
    tally.empty += result.empty
    tally.bad += len(result.bad)
    for number, why in result.bad:
        where = f"{path}:{number}: {why}"
        if cfg.input.on_bad_line == "fail":
            raise DataError(f"{where}; fix the line or set input.on_bad_line: skip to skip such lines")
        if len(tally.examples) < _EXAMPLES:
            tally.examples.append(where)
            reporter.log(f"skipped {where}")
    reporter.update(position, tally.documents, tally.tokens, tally.text_bytes)


def _discard(writer: IndexedDatasetWriter, *tmp_paths: Path) -> None:
    """The tasks still in flight are the caller's to stop: the pool's exit kills its workers on an error."""
    writer.abort()
    for tmp in tmp_paths:
        Path(tmp).unlink(missing_ok=True)
