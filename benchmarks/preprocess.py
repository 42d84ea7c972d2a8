"""Tokenization throughput: runtime.data_prep against Megatron-LM's tools/preprocess_data.py approach.

    python benchmarks/preprocess.py                          # 200 MB corpus, 32k byte-level BPE, 2 workers
    python benchmarks/preprocess.py --mb 50 --workers 4 --workdir /tmp/bench_preprocess

Both sides get the same JSON-lines corpus (generated, deterministic), the same tokenizer file (a 32k byte-level
BPE trained on the corpus, run by the same Rust `tokenizers` library) and the same number of worker processes.
The baseline re-implements Megatron-LM's approach faithfully: the parent reads lines and hands them to a
`multiprocessing.Pool` through `imap(encode, lines, 32)`; each worker parses the JSON and encodes one document
per call; the parent turns every document's list of ids into a numpy array and writes it with one
`add_document` call, then writes the index with a Python loop over the lengths. (Megatron calls the tokenizer
through transformers' wrapper, which is slower still; calling `tokenizers` directly favours the baseline.)
The two outputs must be byte-identical; the script fails if they are not.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import struct
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# --- the corpus ----------------------------------------------------------------------------------------------
def make_corpus(path: Path, megabytes: float, seed: int = 0) -> None:
    """English-like JSON lines: words from the standard library's sources, Zipf-distributed, in sentences and
    paragraphs; documents of log-normal length around 2 KB."""
    words = set()
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        words.update(w.lower() for w in re.findall(r"[A-Za-z]{2,}", source.read_text(errors="replace")))
    rng = np.random.default_rng(seed)
    vocab = np.array(sorted(words), dtype=object)
    rng.shuffle(vocab)
    target, written = int(megabytes * 1e6), 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            n = int(rng.lognormal(5.6, 0.7)) + 8                        # words in the document
            ranks = np.minimum(rng.zipf(1.15, n) - 1, len(vocab) - 1)
            tokens = vocab[ranks]
            ends = rng.random(n) < 1 / 14
            tokens[ends] = tokens[ends] + np.where(rng.random(int(ends.sum())) < 0.2, ".\n\n", ".")
            text = " ".join(tokens).replace("\n\n ", "\n\n")
            line = json.dumps({"text": text[:1].upper() + text[1:], "id": written}) + "\n"
            f.write(line)
            written += len(line)
    tmp.rename(path)


def train_tokenizer(corpus: Path, dest: Path, vocab_size: int) -> None:
    from runtime.schema.data_preparation import TrainConfig
    from runtime.data_prep.tokenizer_train import train_huggingface, training_texts

    texts = training_texts([str(corpus)], "text", max_mb=40)
    dest.write_text(train_huggingface(texts, TrainConfig(model_type="bpe", vocab_size=vocab_size)))


# --- Megatron-LM's approach, re-implemented -----------------------------------------------------------------
class MegatronEncoder:
    """tools/preprocess_data.py's Encoder: the tokenizer is built in each worker; one document per call."""

    def __init__(self, tokenizer_file: str, key: str = "text", append_eod: bool = True):
        self.tokenizer_file, self.key, self.append_eod = tokenizer_file, key, append_eod

    def initializer(self) -> None:
        from tokenizers import Tokenizer

        MegatronEncoder.tokenizer = Tokenizer.from_file(self.tokenizer_file)
        MegatronEncoder.eod = MegatronEncoder.tokenizer.token_to_id("<|endoftext|>")

    def encode(self, json_line: str):
        data = json.loads(json_line)
        ids, lens = {}, {}
        text = data[self.key]
        sentences = text if isinstance(text, list) else [text]
        doc_ids, sentence_lens = [], []
        for sentence in sentences:
            sentence_ids = MegatronEncoder.tokenizer.encode(sentence, add_special_tokens=False).ids
            if sentence_ids:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if doc_ids and self.append_eod:
            doc_ids.append(MegatronEncoder.eod)
            sentence_lens[-1] += 1
        ids[self.key], lens[self.key] = doc_ids, sentence_lens
        return ids, lens, len(json_line)


class MegatronBuilder:
    """megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder, reduced to what preprocessing uses."""

    def __init__(self, bin_path: str, dtype):
        self.data_file, self.dtype = open(bin_path, "wb"), dtype
        self.sequence_lengths, self.document_indices = [], [0]

    def add_document(self, tokens, lengths) -> None:
        np_array = np.array(tokens, dtype=self.dtype)
        self.data_file.write(np_array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        itemsize = np.dtype(self.dtype).itemsize
        pointers, current = [], 0
        for length in self.sequence_lengths:
            pointers.append(current)
            current += length * itemsize
        code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[np.dtype(self.dtype)]
        with open(idx_path, "wb") as f:
            f.write(b"MMIDIDX\x00\x00")
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", code))
            f.write(struct.pack("<Q", len(self.sequence_lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(np.array(self.sequence_lengths, dtype=np.int32).tobytes(order="C"))
            f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
            f.write(np.array(self.document_indices, dtype=np.int64).tobytes(order="C"))


def run_megatron(corpus: Path, tokenizer_file: Path, prefix: Path, workers: int) -> float:
    started = time.perf_counter()
    encoder = MegatronEncoder(str(tokenizer_file))
    fin = open(corpus, encoding="utf-8")
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initializer)
    encoded_docs = pool.imap(encoder.encode, fin, 32)
    builder = MegatronBuilder(f"{prefix}.bin", np.uint16)
    total_bytes = 0
    for i, (doc, sentence_lens, bytes_processed) in enumerate(encoded_docs, start=1):
        total_bytes += bytes_processed
        builder.add_document(doc["text"], sentence_lens["text"])
        if i % 10000 == 0:
            elapsed = time.perf_counter() - started
            print(f"  megatron: {i} documents ({total_bytes / elapsed / 1e6:.1f} MB/s)", flush=True)
    fin.close()
    builder.finalize(f"{prefix}.idx")
    pool.close()
    pool.join()
    return time.perf_counter() - started


# --- ours ----------------------------------------------------------------------------------------------------
def run_ours(corpus: Path, tokenizer_file: Path, out: Path, workers: int, engine: str) -> float:
    from runtime.schema.data_preparation import parse_config
    from runtime.data_prep.progress import Reporter
    from runtime.data_prep.run import run_task

    cfg = parse_config({
        "run": {"name": "bench", "node_array_size": 1}, "workers_per_node": workers, "output_dir": str(out),
        "input": {"source": "files", "files": [str(corpus)]},
        "tokenizer": {"model": str(tokenizer_file), "engine": engine},
        "log_interval_s": 10,
    })
    started = time.perf_counter()
    run_task(cfg, 0, 1, Reporter("  data_prep", interval_s=10, tty=False))
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200, help="corpus size in MB (default 200)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for both (default 2)")
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (default 32000)")
    parser.add_argument("--workdir", default=".cache/bench_preprocess", help="corpus, tokenizer and outputs")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus_{args.mb:g}mb.jsonl"
    if not corpus.exists():
        print(f"generating {corpus} ...", flush=True)
        make_corpus(corpus, args.mb)
    tokenizer_file = work / f"bpe{args.vocab}_{args.mb:g}mb.json"
    if not tokenizer_file.exists():
        print(f"training a {args.vocab} byte-level BPE ...", flush=True)
        train_tokenizer(corpus, tokenizer_file, args.vocab)
    corpus.read_bytes()                       # both start from a warm page cache
    text_mb = corpus.stat().st_size / 1e6
    for stale in work.glob("out*/**/*"):
        if stale.is_file():
            stale.unlink()

    print(f"megatron-style baseline, {args.workers} workers ...", flush=True)
    (work / "out_megatron").mkdir(exist_ok=True)
    seconds = {"megatron": run_megatron(corpus, tokenizer_file, work / "out_megatron" / "corpus", args.workers)}
    reference = [(work / "out_megatron" / f"corpus{s}").read_bytes() for s in (".bin", ".idx")]
    tokens = len(reference[0]) // 2
    same = {}
    # "auto" is the default: tiktoken for this byte-level BPE. "huggingface" shows what batching alone gives.
    for engine in ("auto", "huggingface"):
        print(f"runtime.data_prep (tokenizer.engine: {engine}), {args.workers} workers ...", flush=True)
        out = work / f"out_{engine}"
        seconds[engine] = run_ours(corpus, tokenizer_file, out, args.workers, engine)
        prefix = out / f"{corpus.name.removesuffix('.jsonl')}_text_document"
        same[engine] = [Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx")] == reference

    print(f"\n{'':22}{'seconds':>9}{'MB/s':>8}{'tokens/s':>12}{'speedup':>9}  identical to megatron")
    for name, label in (("megatron", "megatron-style"), ("auto", "ours (default, auto)"),
                        ("huggingface", "ours (huggingface)")):
        s = seconds[name]
        print(f"{label:22}{s:9.1f}{text_mb / s:8.2f}{tokens / s:12,.0f}{seconds['megatron'] / s:8.2f}x  "
              f"{same.get(name, '-')}")
    result = {"corpus_mb": round(text_mb, 1), "documents": (len(reference[1]) - 42) // 20, "tokens": tokens,
              "vocab": args.vocab, "workers": args.workers, "cpus": os.cpu_count(),
              "load_average_1min_after": round(os.getloadavg()[0], 2),
              "seconds": {k: round(v, 2) for k, v in seconds.items()},
              "mb_per_s": {k: round(text_mb / v, 2) for k, v in seconds.items()},
              "tokens_per_s": {k: round(tokens / v) for k, v in seconds.items()},
              "speedup": {k: round(seconds["megatron"] / v, 2) for k, v in seconds.items() if k != "megatron"},
              "identical_output": same}
    print(json.dumps(result))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
