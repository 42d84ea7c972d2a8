"""Shared pieces for the data_preparation tests: a small corpus, small tokenizers, an independent reader of
the indexed format, and a way to run the stage in-process or as `python -m runtime.data_prep`."""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

_WORDS = ("the model data token shard array index train merge vocab byte file line text corpus batch "
          "naïve café Straße 東京 数据 😀 Ελληνικά кошка 42 3.14 , . ; ( ) { } \" ' - _ = + # @").split()


def make_texts(n: int, seed: int = 0, words_per_doc: tuple[int, int] = (5, 120)) -> list[str]:
    """Deterministic documents with unicode, punctuation, newlines, tabs and runs of spaces."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = [rng.choice(_WORDS) if rng.random() < 0.7 else
                 "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxzéü") for _ in range(rng.randint(2, 8)))
                 for _ in range(rng.randint(*words_per_doc))]
        for i in range(1, len(words)):
            if rng.random() < 0.05:
                words[i] = rng.choice(("\n", "\n\n", "\t", "  ")) + words[i]
        texts.append(" ".join(words))
    return texts


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text, "meta": {"n": len(text)}}) + "\n")
    return path


# --- an independent reader of Megatron's MMIDIDX format, written from docs/data_format.md ---------------
_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}


def read_indexed(prefix: str | Path) -> tuple[np.dtype, list[np.ndarray]]:
    """Returns (token dtype, one array per document), checking every header field on the way."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", idx, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", idx, 17)
    dtype = np.dtype(_CODES[code])
    seq_count, doc_index_len = struct.unpack_from("<QQ", idx, 18)
    offset = 34
    lengths = np.frombuffer(idx, "<i4", seq_count, offset)
    offset += 4 * seq_count
    pointers = np.frombuffer(idx, "<i8", seq_count, offset)
    offset += 8 * seq_count
    doc_index = np.frombuffer(idx, "<i8", doc_index_len, offset)
    offset += 8 * doc_index_len
    assert offset == len(idx), "trailing bytes in .idx"
    assert doc_index[0] == 0 and doc_index[-1] == seq_count and np.all(np.diff(doc_index) >= 0)
    data = np.fromfile(f"{prefix}.bin", dtype=dtype.newbyteorder("<"))
    assert data.nbytes == int(lengths.sum()) * dtype.itemsize, "bin size disagrees with the lengths"
    docs = []
    for d in range(doc_index_len - 1):
        parts = []
        for s in range(doc_index[d], doc_index[d + 1]):
            start = pointers[s] // dtype.itemsize
            parts.append(data[start:start + lengths[s]])
        docs.append(np.concatenate(parts) if parts else np.zeros(0, dtype))
    return dtype, docs


# --- tokenizers --------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 600, <|endoftext|> = 0) trained on the test corpus, as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(make_texts(400, seed=99), trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> Path:
    """A SentencePiece unigram model (vocab 300) trained on the test corpus."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(make_texts(400, seed=98)), model_writer=out,
                                             vocab_size=300, model_type="unigram", minloglevel=2,
                                             character_coverage=1.0)
    path = tmp_path_factory.mktemp("spm") / "sp.model"
    path.write_bytes(out.getvalue())
    return path


def hf_ids(tokenizer_file: Path, texts: list[str], eod: int | None = 0) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return [tokenizer.encode(t, add_special_tokens=False).ids + ([eod] if eod is not None else []) for t in texts]


# --- running the stage ---------------------------------------------------------------------------------------
def stage(tmp_path: Path, **sections) -> dict:
    """A resolved stage config for `files` input, with sections overridden (deep-merged one level)."""
    cfg = {
        "run": {"name": "test", "results_dir": str(tmp_path / "results"), "time_limit": "0:10:00",
                "dependency": "singleton", "node_array_size": 2},
        "workers_per_node": 1,
        "output_dir": str(tmp_path / "out"),
        "input": {"source": "files", "files": [str(tmp_path / "in" / "*.jsonl")], "text_key": "text",
                  "on_bad_line": "skip"},
        "tokenizer": {"library": "huggingface"},
        "output": {"append_eod": True, "dtype": "auto"},
        "log_interval_s": 0.01,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def run_inprocess(cfg: dict, task_index: int = 0, num_tasks: int = 1) -> bool:
    from runtime.schema.data_preparation import parse_config
    from runtime.data_prep.progress import Reporter
    from runtime.data_prep.run import run_task

    reporter = Reporter(f"test task {task_index}", interval_s=0.01, tty=False)
    return run_task(parse_config(cfg), task_index, num_tasks, reporter)


def run_cli(cfg: dict, tmp_path: Path, *args: str, wait: bool = True, **popen):
    """Runs the stage as the job script does; returns the finished process, or the Popen if not `wait`."""
    config = tmp_path / f"stage_{abs(hash(json.dumps(cfg, sort_keys=True)))}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-m", "runtime.data_prep", "--config", str(config), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, **popen)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, **popen)
