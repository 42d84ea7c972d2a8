"""Resumable download against a real HTTP server on 127.0.0.1 that supports Range and misbehaves on demand."""
from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading

import pytest

from runtime.schema.data_preparation import DataError
from runtime.data_prep.download import download
from tests.data_prep.conftest import hf_ids, make_texts, read_indexed, run_cli, stage


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    cut_after: dict[str, int] = {}     # path -> bytes to send before dropping the connection (once)
    fail_first: dict[str, int] = {}    # path -> 503 answers before serving
    ignore_range = False
    log: list[tuple[str, str | None]] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).log.append((self.path, self.headers.get("Range")))
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        if self.fail_first.get(self.path, 0) > 0:
            self.fail_first[self.path] -= 1
            self.send_error(503)
            return
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if match and not self.ignore_range:
            start = int(match.group(1))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        payload = body[start:]
        cut = self.cut_after.pop(self.path, None)
        if cut is not None:
            self.wfile.write(payload[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(payload)


@pytest.fixture
def server():
    _Handler.files, _Handler.cut_after, _Handler.fail_first, _Handler.log = {}, {}, {}, []
    _Handler.ignore_range = False
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Handler
    httpd.shutdown()
    httpd.server_close()


def _quiet(_):
    pass


def test_resumes_after_a_dropped_connection(tmp_path, server):
    base, handler = server
    body = bytes(range(256)) * 4000
    handler.files["/f.bin"] = body
    handler.cut_after["/f.bin"] = 300_000
    sha = hashlib.sha256(body).hexdigest()
    path = download(f"{base}/f.bin", tmp_path / "f.bin", checksum=f"sha256:{sha}", backoff_s=0, log=_quiet)
    assert path.read_bytes() == body
    assert handler.log == [("/f.bin", None), ("/f.bin", "bytes=300000-")]
    assert not (tmp_path / "f.bin.part").exists()


def test_resumes_a_partial_file_from_an_earlier_run(tmp_path, server):
    base, handler = server
    body = b"0123456789" * 1000
    handler.files["/f.bin"] = body
    (tmp_path / "f.bin.part").write_bytes(body[:4321])
    download(f"{base}/f.bin", tmp_path / "f.bin", backoff_s=0, log=_quiet)
    assert (tmp_path / "f.bin").read_bytes() == body
    assert handler.log == [("/f.bin", "bytes=4321-")]
    # Already all there: the server answers 416 and nothing is fetched again.
    (tmp_path / "g.bin.part").write_bytes(body)
    handler.files["/g.bin"] = body
    download(f"{base}/g.bin", tmp_path / "g.bin", backoff_s=0, log=_quiet)
    assert (tmp_path / "g.bin").read_bytes() == body


def test_server_without_range_support_restarts(tmp_path, server):
    base, handler = server
    body = b"abc" * 5000
    handler.files["/f.bin"] = body
    handler.ignore_range = True
    (tmp_path / "f.bin.part").write_bytes(b"garbage that must not stay")
    messages = []
    download(f"{base}/f.bin", tmp_path / "f.bin", backoff_s=0, log=messages.append)
    assert (tmp_path / "f.bin").read_bytes() == body
    assert any("ignored the Range request" in m for m in messages)


def test_retries_server_errors_but_not_missing_files(tmp_path, server):
    base, handler = server
    handler.files["/f.bin"] = b"x" * 100
    handler.fail_first["/f.bin"] = 2
    download(f"{base}/f.bin", tmp_path / "f.bin", retries=2, backoff_s=0, log=_quiet)
    assert len(handler.log) == 3
    handler.fail_first["/g.bin"] = 9
    handler.files["/g.bin"] = b"y"
    with pytest.raises(DataError, match="download failed after 3 attempts \\(HTTP 503\\)"):
        download(f"{base}/g.bin", tmp_path / "g.bin", retries=2, backoff_s=0, log=_quiet)
    handler.log.clear()
    with pytest.raises(DataError, match="HTTP 404"):
        download(f"{base}/missing.bin", tmp_path / "m.bin", retries=3, backoff_s=0, log=_quiet)
    assert len(handler.log) == 1


def test_checksum_mismatch_refetches_once_then_fails(tmp_path, server):
    base, handler = server
    handler.files["/f.bin"] = b"the real bytes"
    (tmp_path / "f.bin.part").write_bytes(b"the old")     # a resumed splice that the checksum must catch
    good = hashlib.sha256(b"the real bytes").hexdigest()
    download(f"{base}/f.bin", tmp_path / "f.bin", checksum=good, backoff_s=0, log=_quiet)
    assert (tmp_path / "f.bin").read_bytes() == b"the real bytes"
    with pytest.raises(DataError, match="checksum mismatch after a fresh download"):
        download(f"{base}/f.bin", tmp_path / "h.bin", checksum="md5:" + "0" * 32, backoff_s=0, log=_quiet)
    assert not (tmp_path / "h.bin").exists() and not (tmp_path / "h.bin.part").exists()
    # A complete file with the wrong checksum is fetched again.
    (tmp_path / "f.bin").write_bytes(b"corrupted")
    download(f"{base}/f.bin", tmp_path / "f.bin", checksum=good, backoff_s=0, log=_quiet)
    assert (tmp_path / "f.bin").read_bytes() == b"the real bytes"


def test_url_source_end_to_end(tmp_path, server, hf_tokenizer):
    """source: urls with a {} pattern and file_numbers, .jsonl.zst shards, GPT-2 style vocab/merges URLs."""
    import zstandard
    from tokenizers import Tokenizer

    base, handler = server
    texts = {n: make_texts(40, seed=10 + n) for n in range(3)}
    for n, docs in texts.items():
        raw = "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()
        handler.files[f"/train/{n:02d}.jsonl.zst"] = zstandard.ZstdCompressor().compress(raw)
    handler.cut_after["/train/02.jsonl.zst"] = 100
    Tokenizer.from_file(str(hf_tokenizer)).model.save(str(tmp_path))
    handler.files["/gpt2/vocab.json"] = (tmp_path / "vocab.json").read_bytes()
    handler.files["/gpt2/merges.txt"] = (tmp_path / "merges.txt").read_bytes()
    checksums = {f"{n:02d}.jsonl.zst": hashlib.sha256(handler.files[f"/train/{n:02d}.jsonl.zst"]).hexdigest()
                 for n in (0, 2)}
    cfg = stage(tmp_path, input={"source": "urls", "urls": f"{base}/train/{{:02d}}.jsonl.zst",
                                 "file_numbers": "0,2"},
                download={"dir": str(tmp_path / "dl"), "checksums": checksums, "backoff_s": 0,
                          "remove_after_preprocess": True},
                tokenizer={"vocab_file": f"{base}/gpt2/vocab.json", "merge_file": f"{base}/gpt2/merges.txt"})
    result = run_cli(cfg, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for n in (0, 2):
        _, docs = read_indexed(tmp_path / "out" / f"{n:02d}_text_document")
        assert [d.tolist() for d in docs] == hf_ids(hf_tokenizer, texts[n])
    assert not list((tmp_path / "dl").iterdir()), "downloads are removed after tokenizing"
    assert ("/train/02.jsonl.zst", "bytes=100-") in handler.log
    assert not any(path == "/train/01.jsonl.zst" for path, _ in handler.log)
    # A rerun downloads nothing: finished shards are recognized by URL, not by the deleted download.
    handler.log.clear()
    assert run_cli(cfg, tmp_path).returncode == 0
    assert not any(path.startswith("/train/") for path, _ in handler.log), handler.log
