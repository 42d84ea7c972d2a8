"""Every input format gives the same tokens as tokenizing the texts directly; bad input is handled per config."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from runtime.schema.data_preparation import DataError
from tests.data_prep.conftest import hf_ids, make_texts, read_indexed, run_cli, run_inprocess, stage, write_jsonl

TEXTS = make_texts(60, seed=1)


def _write(path, fmt):
    lines = "".join(json.dumps({"body": t}) + "\n" for t in TEXTS).encode()
    if fmt == "jsonl":
        path.write_bytes(lines)
    elif fmt == "json_lines":
        path.write_bytes(lines)
    elif fmt == "json_array":
        path.write_text(json.dumps([{"body": t} for t in TEXTS]))
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(lines))
    elif fmt == "jsonl.zst":
        import zstandard

        # Two frames back to back, as concatenated .zst files are: the reader must cross frames.
        half = len(lines) // 2
        half = lines.rindex(b"\n", 0, half) + 1
        compress = zstandard.ZstdCompressor(level=3).compress
        path.write_bytes(compress(lines[:half]) + compress(lines[half:]))
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": TEXTS, "id": list(range(len(TEXTS)))}), path, row_group_size=17)


@pytest.mark.parametrize("fmt, suffix", [("jsonl", ".jsonl"), ("json_lines", ".json"), ("json_array", ".json"),
                                         ("jsonl.gz", ".jsonl.gz"), ("jsonl.zst", ".jsonl.zst"),
                                         ("parquet", ".parquet")])
def test_input_formats(tmp_path, hf_tokenizer, fmt, suffix):
    (tmp_path / "in").mkdir()
    _write(tmp_path / "in" / f"shard{suffix}", fmt)
    cfg = stage(tmp_path, input={"files": [str(tmp_path / "in" / f"shard{suffix}")], "text_key": "body"},
                tokenizer={"model": str(hf_tokenizer)}, chunk_mb=0.002)
    assert run_inprocess(cfg)
    dtype, docs = read_indexed(tmp_path / "out" / "shard_text_document")
    assert dtype == np.uint16
    assert [d.tolist() for d in docs] == hf_ids(hf_tokenizer, TEXTS)
    blend = (tmp_path / "out" / "blend.txt").read_text().split()
    assert blend == [str(sum(d.size for d in docs)), str(tmp_path / "out" / "shard_text_document")]


def _bad_input(tmp_path):
    lines = [json.dumps({"text": TEXTS[0]}), '{"text": "unterminated', json.dumps({"text": "   "}),
             json.dumps({"other": "no text key"}), "", json.dumps({"text": TEXTS[1]}), json.dumps({"text": 5}),
             "[1, 2]", json.dumps({"text": ""}), json.dumps({"text": TEXTS[2]})]
    path = tmp_path / "in" / "bad.jsonl"
    path.parent.mkdir()
    # Line 11: invalid UTF-8. Line 12: a lone surrogate, valid JSON that no tokenizer accepts.
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "\xff\xfe"}\n' + b'{"text": "a\\ud800b"}\n')
    return path


def test_malformed_lines_skipped_and_counted(tmp_path, hf_tokenizer, capsys):
    path = _bad_input(tmp_path)
    assert run_inprocess(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}))
    _, docs = read_indexed(tmp_path / "out" / "bad_text_document")
    assert [d.tolist() for d in docs] == hf_ids(hf_tokenizer, TEXTS[:3])
    summary = json.loads((tmp_path / "out" / "summaries" / "bad.json").read_text())
    assert (summary["documents"], summary["skipped_lines"], summary["empty_documents"]) == (3, 6, 2)
    log = capsys.readouterr().out
    for line in (2, 4, 7, 8, 11, 12):  # file:line for each, 1-based, the blank line 5 is no error
        assert f"{path}:{line}: " in log, log
    assert "malformed JSON" in log and "no 'text' key" in log and "'text' holds int" in log
    assert "the tokenizer rejected the text" in log
    stage_summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert stage_summary["skipped_lines"] == 6 and stage_summary["documents"] == 3


def test_malformed_line_fatal_when_configured(tmp_path, hf_tokenizer):
    path = _bad_input(tmp_path)
    cfg = stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}, input={"on_bad_line": "fail"})
    with pytest.raises(DataError, match=f"{path}:2: malformed JSON"):
        run_inprocess(cfg)
    result = run_cli(cfg, tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {path}:2: malformed JSON") and "Traceback" not in result.stderr
    assert "on_bad_line: skip" in result.stderr
    assert not (tmp_path / "out" / "bad_text_document.bin").exists()
    assert not (tmp_path / "out" / "summaries" / "bad.json").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp-" in p.name]


def test_zero_tokens_is_a_failure(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "good.jsonl", TEXTS[:3])
    write_jsonl(tmp_path / "in" / "empty.jsonl", ["", "  ", "\n"])
    cfg = stage(tmp_path, tokenizer={"model": str(hf_tokenizer)})
    result = run_cli(cfg, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "empty.jsonl: no tokens written (0 bad lines, 3 empty documents" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "summaries" / "empty.json").exists()
    assert not (tmp_path / "out" / "blend.txt").exists()


def test_wrong_text_key(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS[:3], key="content")
    with pytest.raises(DataError, match="no tokens written \\(3 bad lines"):
        run_inprocess(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}))


def test_worker_count_does_not_change_output(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "a.jsonl", make_texts(300, seed=5))
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}"
        cfg = stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}, workers_per_node=workers,
                    output_dir=str(out), chunk_mb=0.003)
        run_inprocess(cfg)
        outputs.append(((out / "a_text_document.bin").read_bytes(), (out / "a_text_document.idx").read_bytes()))
    assert outputs[0] == outputs[1]
