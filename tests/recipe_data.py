"""A data directory holding what every recipe's training stage reads, so that the runtime's own config loader
(runtime.config) can check each recipe (a plugin of tests/conftest.py, for the recipe, schema and launcher tests): tokenizer.json files with the real vocabulary sizes (the padded vocabulary
must divide by tp) and blend files whose token files exist (empty: nothing is read)."""

import functools
import json
from pathlib import Path

import pytest

# Directory under data_dir (as the recipes name it) -> vocabulary size of the real tokenizer.
TOKENIZERS = {"demo": 4096, "the_pile_gpt2": 50257, "llama2": 32000, "llama3": 128256, "qwen2_5": 151665,
              "qwen3": 151669}


def write_tokenizer(path: Path, vocab: int) -> None:
    """A valid Hugging Face tokenizer.json (BPE, no merges) with `vocab` tokens."""
    path.write_text(_tokenizer_json(vocab))


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab: int) -> str:
    """Once per vocabulary size and session: a 262k-token file takes a second to build."""
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "vocab": {f"t{i}": i for i in range(vocab)}, "merges": []}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": model})


@pytest.fixture(scope="session")
def recipe_data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipe_data")
    for name, vocab in TOKENIZERS.items():
        folder = root / name
        folder.mkdir()
        write_tokenizer(folder / "tokenizer.json", vocab)
        for suffix in (".idx", ".bin"):
            (folder / f"corpus{suffix}").write_bytes(b"")
        (folder / "blend.txt").write_text("1.0 corpus\n")
    return root


def write_hf_weights(directory: Path, config: dict, vocab: int) -> None:
    """The model.safetensors of `config` (a published config.json) as its publisher's names, shapes and dtype in a
    real header, its data a sparse hole: a launch's header check (runtime/schema/safetensors_file.py) sees a
    whole file, at no disk cost, and nothing in a dry run reads the data."""
    header, data_bytes = _hf_header(json.dumps(config, sort_keys=True), vocab)
    with open(directory / "model.safetensors", "wb") as file:
        file.write(len(header).to_bytes(8, "little") + header)
        file.truncate(8 + len(header) + data_bytes)


@functools.lru_cache(maxsize=None)
def _hf_header(config: str, vocab: int) -> tuple[bytes, int]:
    """(safetensors header, data bytes) of a config.json's model, once per session: a 70B's takes seconds."""
    import torch

    from runtime.convert import model_keys, to_hf
    from runtime.convert.hf import state_shapes
    from runtime.models import ModelConfig

    keys = model_keys(json.loads(config), tokenizer_vocab_size=vocab)
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size=vocab)
    ours = {name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in state_shapes(cfg).items()
            if not (cfg.share_embeddings_and_output_weights and name == "output.weight")}  # a tied head: stored once
    header, offset = {}, 0
    for name, tensor in sorted(to_hf(ours, cfg)[0].items()):
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    return text + b" " * (-len(text) % 8), offset
