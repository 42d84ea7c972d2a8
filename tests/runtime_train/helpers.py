# Helpers for the trainer tests: a minimal MMIDIDX writer of their own (so the reader is checked against an
# independent implementation of the format, not against itself), a tiny tokenizer.json built offline, and the
# reference training configs resolved the way the launcher resolves them.
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def write_mmidx(prefix, sequences, dtype=np.uint16, document_indices=None) -> str:
    """Write <prefix>.bin/.idx straight from the format description: header, sizes, pointers, doc indices."""
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    arrays = [np.asarray(s, dtype=dtype) for s in sequences]
    sizes = np.array([len(a) for a in arrays], dtype=np.int32)
    pointers = np.zeros(len(arrays), dtype=np.int64)
    if len(arrays) > 1:
        pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * np.dtype(dtype).itemsize
    if document_indices is None:  # one document per sequence, as GPT data usually is
        document_indices = np.arange(len(arrays) + 1)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    with open(prefix + ".bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", _CODES[dtype]))
        f.write(struct.pack("<Q", len(arrays)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(document_indices.tobytes())
    return prefix


def build_tokenizer(path, words) -> int:
    """A WordLevel tokenizer.json over `words` plus <unk>; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>"], min_frequency=1)
    tokenizer.train_from_iterator([" ".join(words)], trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer.get_vocab_size()


REPO = Path(__file__).resolve().parents[2]


def reference_training_config(architecture: str, *, results_dir, data_prefix, tokenizer) -> dict:
    """conf/training/<arch>/tiny.yaml resolved the way the launcher resolves it, with test paths filled in."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("multiply"):
        OmegaConf.register_new_resolver("multiply", lambda a, b: a * b)
    gpt = OmegaConf.load(REPO / "conf/training/gpt3/tiny.yaml")
    stage = gpt
    if architecture == "llama":
        llama = OmegaConf.load(REPO / "conf/training/llama/tiny.yaml")
        llama.pop("defaults")
        stage = OmegaConf.merge(gpt, llama)
    root = OmegaConf.create({"base_results_dir": "unused", "run_name": "unused", "data_dir": "unused"})
    root.training = stage
    resolved = OmegaConf.to_container(root, resolve=True)["training"]
    resolved["run"]["results_dir"] = str(results_dir)
    resolved["model"]["data"]["data_prefix"] = data_prefix
    resolved["model"]["tokenizer"]["model"] = str(tokenizer)
    return resolved
