"""Damaged and oversized inputs, as real files: a truncated .gz or .zst fails its shard with one line naming the
file and the byte where the input ended, and nothing of it is published; a record longer than
input.max_record_mb is reported and skipped (or fails the task) without ever being held whole."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest
import zstandard

from runtime.data_prep.readers import iter_chunks
from runtime.schema.data_preparation import DataError
from tests.data_prep.conftest import REPO, hf_ids, make_texts, read_indexed, run_cli, run_inprocess, stage
from tests.data_prep.conftest import write_jsonl

TEXTS = make_texts(400, seed=11)
LINES = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()


def _frames(data: bytes, pieces: int, **options) -> tuple[bytes, list[int]]:
    """`data` compressed as `pieces` zstd frames cut at arbitrary bytes (not line ends); also where each starts."""
    cuts = [len(data) * k // pieces for k in range(pieces + 1)]
    frames = [zstandard.ZstdCompressor(**options).compress(data[a:b]) for a, b in zip(cuts, cuts[1:])]
    starts = [sum(len(f) for f in frames[:k]) for k in range(pieces)]
    return b"".join(frames), starts


def _stage_with(tmp_path, hf_tokenizer, **input_keys):
    return stage(tmp_path, input={"files": [str(tmp_path / "in" / "*")], **input_keys},
                 tokenizer={"model": str(hf_tokenizer)}, chunk_mb=0.01)


def _assert_failed_unpublished(result, tmp_path, name: str, first_words: str):
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: {first_words}"), result.stderr
    out = tmp_path / "out"
    assert not (out / "summaries" / f"{name}.json").exists(), "a failed shard was marked complete"
    assert not (out / f"{name}_text_document.bin").exists()
    assert not (out / "blend.txt").exists() and not (out / "summary.json").exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    # The good shard next to it is complete: only the damaged one is held back.
    assert (out / "summaries" / "a_good.json").exists()


# ---------------------------------------------------------------------------------------- truncated inputs
_ZST, _ZST_STARTS = _frames(LINES, 3, level=3, write_checksum=True)


@pytest.mark.parametrize("cut", [
    5,                                      # inside the first frame's header
    len(_ZST) // 2,                         # mid-frame
    _ZST_STARTS[1] + 1,                     # one byte past a frame boundary: inside the next magic number
    _ZST_STARTS[2] + 6,                     # inside the last frame's header
    len(_ZST) - 3,                          # inside the last frame's checksum
], ids=["header", "mid-frame", "after-boundary", "last-header", "checksum"])
def test_truncated_zst_fails_the_shard(tmp_path, hf_tokenizer, cut):
    frame_start = max(start for start in _ZST_STARTS if start < cut)
    write_jsonl(tmp_path / "in" / "a_good.jsonl", TEXTS[:5])
    path = tmp_path / "in" / "cut.jsonl.zst"
    path.write_bytes(_ZST[:cut])
    result = run_cli(_stage_with(tmp_path, hf_tokenizer), tmp_path)
    _assert_failed_unpublished(result, tmp_path, "cut",
                               f"{path}: truncated: the input ends at byte {cut} inside the zstd frame that starts "
                               f"at byte {frame_start}; fetch or write the file again")


_GZ = gzip.compress(LINES[:len(LINES) // 2], mtime=0)
_GZ_TWO = _GZ + gzip.compress(LINES[len(LINES) // 2:], mtime=0)


@pytest.mark.parametrize("data, cut", [
    (_GZ, 6),                               # inside the header
    (_GZ, len(_GZ) // 2),                   # mid-stream
    (_GZ, len(_GZ) - 4),                    # the CRC is there, the length is not
    (_GZ_TWO, len(_GZ) + 5),                # inside the second member's header
    (_GZ_TWO, len(_GZ_TWO) - 100),          # inside the second member's data
], ids=["header", "mid-stream", "trailer", "second-header", "second-member"])
def test_truncated_gz_fails_the_shard(tmp_path, hf_tokenizer, data, cut):
    write_jsonl(tmp_path / "in" / "a_good.jsonl", TEXTS[:5])
    path = tmp_path / "in" / "cut.jsonl.gz"
    path.write_bytes(data[:cut])
    result = run_cli(_stage_with(tmp_path, hf_tokenizer), tmp_path)
    _assert_failed_unpublished(result, tmp_path, "cut",
                               f"{path}: truncated: the input ends at byte {cut} before the gzip end-of-stream "
                               "marker; fetch or write the file again")


def test_corrupt_zst_names_the_byte(tmp_path):
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(_ZST[:_ZST_STARTS[1]] + b"not zstd at all")
    with pytest.raises(DataError, match=f"^{path}: byte {_ZST_STARTS[1]} does not start a zstd frame"):
        list(iter_chunks(str(path)))


def test_unclosed_json_array_fails(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "a_good.jsonl", TEXTS[:5])
    text = json.dumps([{"text": t} for t in TEXTS[:50]]).encode()
    path = tmp_path / "in" / "cut.json.gz"
    path.write_bytes(gzip.compress(text[:len(text) // 2]))   # a whole gzip stream of half an array
    result = run_cli(_stage_with(tmp_path, hf_tokenizer), tmp_path)
    _assert_failed_unpublished(result, tmp_path, "cut", f"{path}: the JSON array is not closed: the text ends at "
                                                       f"byte {len(text) // 2}")


def test_good_multi_frame_zst_reads_fully(tmp_path, hf_tokenizer):
    """Frames cut mid-line, a skippable frame, an empty frame, frames with checksums and without content sizes."""
    half = len(LINES) // 2
    skippable = (0x184D2A53).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    empty = zstandard.ZstdCompressor().compress(b"")
    first, _ = _frames(LINES[:half], 7, level=1)
    second, _ = _frames(LINES[half:], 2, write_checksum=True, write_content_size=False)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "frames.jsonl.zst").write_bytes(skippable + empty + first + second)
    assert run_inprocess(stage(tmp_path, input={"files": [str(tmp_path / "in" / "*")]},
                               tokenizer={"model": str(hf_tokenizer)}, chunk_mb=0.003))
    _, docs = read_indexed(tmp_path / "out" / "frames_text_document")
    assert [d.tolist() for d in docs] == hf_ids(hf_tokenizer, TEXTS)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command")
@pytest.mark.parametrize("options", [["-3"], ["--long=31", "-19"], ["-T2", "--rsyncable"], ["--no-check", "-1"]])
def test_zstd_command_output_reads_fully_and_truncated_fails(tmp_path, options):
    plain = tmp_path / "x.jsonl"
    plain.write_bytes(LINES * 20)
    subprocess.run(["zstd", "-q", "-f", *options, str(plain), "-o", str(tmp_path / "x.jsonl.zst")], check=True)
    data = (tmp_path / "x.jsonl.zst").read_bytes()
    assert b"".join(c.payload for c in iter_chunks(str(tmp_path / "x.jsonl.zst"))) == LINES * 20
    for cut in (len(data) // 3, len(data) - 1):
        (tmp_path / "x.jsonl.zst").write_bytes(data[:cut])
        with pytest.raises(DataError, match=f"truncated: the input ends at byte {cut} inside the zstd frame"):
            list(iter_chunks(str(tmp_path / "x.jsonl.zst")))


# ------------------------------------------------------------------------------------------- long records
LIMIT_MB = 0.002                               # 2,000 bytes
SHORT = TEXTS[:6]
LONG_A, LONG_B = "long " * 500, "longer " * 1000   # 2,500 and 7,000 characters


def _write_long(path, fmt):
    """SHORT with LONG_A after its second text and LONG_B last (no newline after it in JSON lines)."""
    texts = [*SHORT[:2], LONG_A, *SHORT[2:], LONG_B]
    records = [json.dumps({"text": t}) for t in texts]
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
        return [len(LONG_A.encode()), len(LONG_B.encode())]
    if fmt == "json":
        data = ("[\n" + ",\n".join(records) + "\n]").encode()
        sizes = [len(records[2]) + 1, len(records[-1]) + 2]   # a value's bytes include the whitespace around it
    else:
        data = "\n".join(records).encode()
        sizes = [len(records[2]), len(records[-1])]
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if fmt.endswith(".zst") else data)
    return sizes


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst", "json", "parquet"])
def test_long_records_skipped_and_reported(tmp_path, hf_tokenizer, capsys, fmt):
    path = tmp_path / "in" / f"long.{fmt}"
    sizes = _write_long(path, fmt)
    cfg = stage(tmp_path, input={"files": [str(path)], "max_record_mb": LIMIT_MB},
                tokenizer={"model": str(hf_tokenizer)}, chunk_mb=0.0005)   # blocks smaller than the limit, too
    assert run_inprocess(cfg)
    _, docs = read_indexed(tmp_path / "out" / "long_text_document")
    assert [d.tolist() for d in docs] == hf_ids(hf_tokenizer, SHORT)
    summary = json.loads((tmp_path / "out" / "summaries" / "long.json").read_text())
    assert summary["long_records"] == 2 and summary["documents"] == len(SHORT)
    assert summary["skipped_lines"] == 0 and summary["empty_documents"] == 0
    expected = [f"{path}:3: a record of {sizes[0]:,} bytes, longer than input.max_record_mb (0.002 MB)",
                f"{path}:8: a record of {sizes[1]:,} bytes, longer than input.max_record_mb (0.002 MB)"]
    assert summary["long_record_examples"] == expected
    log = capsys.readouterr().out
    assert all(f"skipped {line}" in log for line in expected), log
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["long_records"] == 2


def test_long_record_fails_when_configured(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "in" / "a_good.jsonl", TEXTS[:5])
    path = tmp_path / "in" / "long.jsonl"
    sizes = _write_long(path, "jsonl")
    result = run_cli(_stage_with(tmp_path, hf_tokenizer, max_record_mb=LIMIT_MB, on_long_record="fail"), tmp_path)
    _assert_failed_unpublished(result, tmp_path, "long",
                               f"{path}:3: a record of {sizes[0]:,} bytes, longer than input.max_record_mb "
                               "(0.002 MB); raise input.max_record_mb or set input.on_long_record: skip to skip "
                               "such records")


def test_lines_within_and_over_the_limit_across_block_sizes(tmp_path):
    """The line cutter against a plain split, for every block size from 1 byte up: the same lines, the same
    numbers, the long ones listed with their sizes and left empty."""
    lines = [b"a" * n for n in (0, 3, 10, 11, 2, 25, 0, 10, 9, 40, 1)]
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\n".join(lines))
    expected = [line if len(line) <= 10 else b"" for line in lines]
    too_long = [(number, len(line)) for number, line in enumerate(lines, 1) if len(line) > 10]
    for block in range(1, 60):
        chunks = list(iter_chunks(str(path), chunk_bytes=block, max_record_bytes=10))
        assert b"".join(c.payload for c in chunks).split(b"\n") == expected, block
        assert [t for c in chunks for t in c.too_long] == too_long, block
        for chunk in chunks:       # each chunk's numbering agrees with the lines it holds
            for number, _ in chunk.too_long:
                assert chunk.first_line <= number <= chunk.first_line + chunk.payload.count(b"\n")


def test_json_array_values_across_block_sizes(tmp_path):
    """Strings holding brackets, commas, quotes and backslashes, nested values, pretty-printing: every value cut
    out exactly, whatever the block size, and the long one listed and left empty."""
    values = [{"text": 'a "quoted" [bracket], {brace} \\ back\\slash \n', "n": [1, {"x": [2, 3]}]}, "]", 7,
              {"text": "é 数 😀" * 10}, [[], {}], {"text": "x" * 500}, None]
    for indent in (None, 2):
        text = json.dumps(values, indent=indent, ensure_ascii=indent is None).encode()
        path = tmp_path / "x.json"
        path.write_bytes(b" \n" + text + b"\n")
        for block in (1, 2, 3, 5, 7, 64, 1 << 20):
            chunks = list(iter_chunks(str(path), chunk_bytes=block, max_record_bytes=400))
            assert all(c.kind == "values" for c in chunks)
            got = [value for c in chunks for value in c.payload]
            assert [json.loads(v) for i, v in enumerate(got) if i != 5] == values[:5] + values[6:], (indent, block)
            assert got[5] == b"" and [t[0] for c in chunks for t in c.too_long] == [6]


# ------------------------------------------------------------------------------------------------ memory
_PEAK = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=False, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)   # KiB: the largest process of the stage
"""


def _peak_kib(cfg, tmp_path, name) -> int:
    import yaml

    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-c", _PEAK, sys.executable, "-m", "runtime.data_prep", "--config", str(config)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_a_50_mb_record_is_never_held(tmp_path, hf_tokenizer, suffix):
    """The largest process of a run over one 50 MB line stays within 25 MB of a run over a small file: the line
    is streamed past in 1 MB blocks, never held, parsed or tokenized (before this, 5.4 GB)."""
    small, big = tmp_path / "small" / f"s{suffix}", tmp_path / "big" / f"b{suffix}"
    head = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20]).encode()
    line = b'{"text": "' + b"word " * 10_000_000 + b'"}\n'
    for path, data in ((small, head), (big, head + line + head)):
        path.parent.mkdir()
        path.write_bytes(zstandard.ZstdCompressor(level=1).compress(data) if suffix.endswith(".zst") else data)
    del line
    peaks = []
    for path in (small, big):
        cfg = stage(tmp_path, input={"files": [str(path)], "max_record_mb": 1},
                    tokenizer={"model": str(hf_tokenizer)}, output_dir=str(path.parent / "out"))
        peaks.append(_peak_kib(cfg, tmp_path, path.parent.name))
    summary = json.loads((big.parent / "out" / "summaries" / "b.json").read_text())
    assert summary["long_records"] == 1 and summary["documents"] == 40
    assert peaks[1] < peaks[0] + 25 * 1024, f"peak RSS {peaks[1] / 1024:.0f} MB vs {peaks[0] / 1024:.0f} MB"
