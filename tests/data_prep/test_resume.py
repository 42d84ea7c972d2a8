"""Killed runs resume to exactly the output of a clean run; finished shards are kept, partial ones never are."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.data_prep.conftest import make_texts, read_indexed, run_cli, run_inprocess, stage, write_jsonl


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """a.jsonl (small, finishes first) and b.jsonl (large enough to be killed on the way: 2.6 MB, its partial .bin
    caught past 100 KB, a few percent in, seconds before its end even on a loaded machine; each test and the clean
    run encode it all once more, so its size is most of this file's CPU)."""
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(root / "a.jsonl", make_texts(300, seed=20))
    write_jsonl(root / "b.jsonl", make_texts(8 * 1000, seed=21, words_per_doc=(20, 60)))
    return root


def _cfg(tmp_path, corpus, hf_tokenizer, out, **extra):
    # engine huggingface: the slower engine leaves time to kill the task while shard b is under way.
    return stage(tmp_path, input={"files": [str(corpus / "*.jsonl")]},
                 tokenizer={"model": str(hf_tokenizer), "engine": "huggingface"},
                 output_dir=str(out), chunk_mb=0.05, workers_per_node=2, **extra)


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*_text_document.*"))} | {
        "blend": (out / "blend.txt").read_text().replace(str(out), "OUT").encode()}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, corpus, hf_tokenizer) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("clean")
    run_inprocess(_cfg(tmp, corpus, hf_tokenizer, tmp / "out"))
    return _outputs(tmp / "out")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for whoever adopted it to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _partial_b(out: Path) -> list[Path]:
    return [p for p in out.glob("b_text_document.bin.tmp-*") if p.stat().st_size > 100_000]


def test_kill_9_mid_shard_then_rerun(tmp_path, corpus, hf_tokenizer, clean):
    out = tmp_path / "out"
    cfg = _cfg(tmp_path, corpus, hf_tokenizer, out)
    proc = run_cli(cfg, tmp_path, wait=False, start_new_session=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(lambda: _partial_b(out)), "shard b never got under way"
        workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)          # the task dies mid-shard, as on a node failure
        proc.wait()
        # Orphaned workers notice their parent is gone and leave.
        assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert (out / "summaries" / "a.json").exists() and not (out / "summaries" / "b.json").exists()
    assert not (out / "blend.txt").exists()
    a_mtime = (out / "a_text_document.bin").stat().st_mtime_ns
    result = run_cli(cfg, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "a: already complete, skipping" in result.stdout
    assert "b: removed 1 partial files of an interrupted run" in result.stdout
    assert (out / "a_text_document.bin").stat().st_mtime_ns == a_mtime
    assert _outputs(out) == clean
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_killed_worker_fails_the_task_and_rerun_recovers(tmp_path, corpus, hf_tokenizer, clean):
    out = tmp_path / "out"
    cfg = _cfg(tmp_path, corpus, hf_tokenizer, out)
    proc = run_cli(cfg, tmp_path, wait=False, start_new_session=True, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: _partial_b(out)), "shard b never got under way"
        workers = [c for c in _children(proc.pid)
                   if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text() and
                   "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
        assert workers
        os.kill(workers[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1
    assert stderr.startswith("error: a tokenizer worker died while encoding") and "Traceback" not in stderr
    assert not (out / "summaries" / "b.json").exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name], "the failing task cleans up its partial files"
    assert run_cli(cfg, tmp_path).returncode == 0
    assert _outputs(out) == clean


def test_changed_settings_redo_finished_shards(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "a.jsonl", make_texts(50, seed=30))
    cfg = stage(tmp_path, tokenizer={"model": str(hf_tokenizer)})
    run_inprocess(cfg)
    _, with_eod = read_indexed(tmp_path / "out" / "a_text_document")
    run_inprocess(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}, output={"append_eod": False}))
    _, without = read_indexed(tmp_path / "out" / "a_text_document")
    assert [d[:-1].tolist() for d in with_eod] == [d.tolist() for d in without]
    # A summary whose files were tampered with (or truncated) is not taken for done.
    summary = json.loads((tmp_path / "out" / "summaries" / "a.json").read_text())
    with open(tmp_path / "out" / "a_text_document.bin", "r+b") as f:
        f.truncate(summary["bin_bytes"] - 2)
    run_inprocess(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}, output={"append_eod": False}))
    assert (tmp_path / "out" / "a_text_document.bin").stat().st_size == summary["bin_bytes"]
