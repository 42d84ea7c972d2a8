"""The stage's last step: once every shard is done, `<output_dir>/blend.txt` and `<output_dir>/summary.json`.

Every task calls `try_finalize` after its own shards; whichever finds all shard summaries in place writes
the two files. Both are written atomically and depend only on the summaries, so two tasks finishing
together write the same bytes (apart from `finalized_at`), and a rerun rewrites them identically.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from runtime.schema.data_preparation import StageConfig
from runtime.io.files import atomic_write_bytes, atomic_write_json
from runtime.data_prep.plan import Shard
from runtime.data_prep.shard import done_summary


def blend_lines(cfg: StageConfig, summaries: list[dict[str, Any]]) -> list[str]:
    """Megatron-DeepSpeed's DATA_FILE_LIST: `weight prefix` per line; weights are relative, not normalized."""
    lines = []
    for summary in summaries:
        weights = cfg.output.blend_weights
        weight = repr(float(weights[summary["shard"]])) if weights else str(summary["tokens"])
        lines.append(f"{weight} {summary['prefix']}")
    return lines


def try_finalize(cfg: StageConfig, shards: list[Shard], expected: Callable[[Shard], dict[str, Any]],
                 log: Callable[[str], None]) -> bool:
    """Writes blend.txt and summary.json if every shard is done; True when it did."""
    summaries, missing = [], []
    for shard in shards:
        summary = done_summary(cfg, shard, expected(shard))
        (summaries.append(summary) if summary else missing.append(shard.name))
    if missing:
        log(f"{len(summaries)}/{len(shards)} shards complete (waiting for {', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); the task that completes the last one writes blend.txt")
        return False
    out = Path(cfg.output_dir)
    atomic_write_bytes(out / "blend.txt", ("\n".join(blend_lines(cfg, summaries)) + "\n").encode())
    totals = {key: sum(s[key] for s in summaries) for key in
              ("documents", "tokens", "text_bytes", "skipped_lines", "long_records", "empty_documents", "bin_bytes")}
    stage = {
        **totals,
        "shards": len(summaries),
        "shard_seconds": round(sum(s["seconds"] for s in summaries), 3),
        "wall_seconds": round(max(s["finished_at"] for s in summaries) - min(s["started_at"] for s in summaries), 3),
        "tokenizer": str(out / "tokenizer.json"),
        "vocab_size": summaries[0]["vocab_size"],
        "dtype": summaries[0]["dtype"],
        "blend": str(out / "blend.txt"),
        "per_shard": [{k: s[k] for k in ("shard", "prefix", "documents", "tokens", "text_bytes", "skipped_lines",
                                         "long_records", "empty_documents", "seconds")} for s in summaries],
        "finalized_at": time.time(),
    }
    atomic_write_json(out / "summary.json", stage)
    if cfg.run.results_dir:
        atomic_write_json(os.path.join(cfg.run.results_dir, "summary.json"), stage)
    left_out = (f", {totals['long_records']:,} records over input.max_record_mb skipped" if totals["long_records"]
                else "")
    log(f"all {len(summaries)} shards complete: {totals['documents']:,} documents, {totals['tokens']:,} tokens"
        f"{left_out}; wrote {out / 'blend.txt'} and {out / 'summary.json'}")
    return True
