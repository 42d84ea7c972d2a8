"""A full disk in data preparation (issue 57): one `error:` line naming output_dir and the fix, exit 1, no
traceback and no `*.tmp-*` file left; the rerun with room finishes from where it stopped. The disk fills by the
file-size limit (tests/full_disk.py simulates ENOSPC with RLIMIT_FSIZE: EFBIG), as the tokenizer is published
and in a shard's .bin."""
from __future__ import annotations

import errno

import pytest

from runtime.io import files
from tests.data_prep.conftest import make_texts, read_indexed, run_cli, stage, write_jsonl
from tests.full_disk import file_size_limit


@pytest.mark.parametrize("max_bytes,where", [(3_000, "the tokenizer"), (100_000, "a shard's .bin")])
def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path, hf_tokenizer, max_bytes, where):
    write_jsonl(tmp_path / "in" / "a.jsonl", make_texts(400, seed=3))
    cfg = stage(tmp_path, tokenizer={"model": str(hf_tokenizer)})
    out = tmp_path / "out"
    result = run_cli(cfg, tmp_path, preexec_fn=file_size_limit(max_bytes))
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: output_dir '{out}': no room to write (File too large); nothing "
                               "half-written was kept"), lines
    assert "set output_dir to a disk with room" in lines[0]
    assert not [p for p in out.rglob("*") if files.is_temp(p.name)], f"{where}: temporary files left"
    assert not (out / "summary.json").exists()

    again = run_cli(cfg, tmp_path)  # room again: the stage finishes
    assert again.returncode == 0, again.stderr
    assert len(read_indexed(out / "a_text_document")[1]) == 400


@pytest.mark.parametrize("code", files.NO_ROOM)
def test_a_full_disk_a_full_quota_and_a_file_size_limit_are_handled_alike(tmp_path, monkeypatch, code):
    """ENOSPC and EDQUOT cannot be made here without root: the same write path, failing with each errno."""
    def full(fd):
        raise OSError(code, errno.errorcode[code])

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError) as raised:
        files.atomic_write_bytes(tmp_path / "blend.txt", b"x" * 100)
    assert files.no_room(raised.value) and list(tmp_path.iterdir()) == []
    line = files.no_room_line(raised.value, "output_dir", tmp_path)
    assert line.startswith(f"output_dir '{tmp_path}': no room to write ({raised.value.strerror})") and "\n" not in line
