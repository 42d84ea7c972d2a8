"""Tiny llama3 / qwen3 checkpoints of ours for tests/convert/test_titan_dcp.py: trained two steps in gloo ranks at a
tp x pp layout (tests/checkpoint/harness.py's build and step) and saved with a config.yaml whose model section
conversion reads (a small tokenizer.json gives its vocabulary)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from runtime.checkpoint import Checkpointer
from runtime.schema.model import ModelConfig
from tests.checkpoint import harness as CH
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

VOCAB = 128
# Our model keys for each family (the tiny llama of tests/runtime_parallel/harness.py; qwen3 with q/k norms and a
# head size apart from hidden / heads). eps is torchtitan llama3's (its builders fix it; conversion sets it anyway).
FAMILIES = {"llama3": dict(layernorm_epsilon=1e-5), "qwen3": dict(qk_layernorm=True, kv_channels=12,
                                                                  layernorm_epsilon=1e-6)}
CONSUMED = 48  # the data position saved with every checkpoint


def tokenizer(path: Path) -> str:
    """A tokenizer.json with VOCAB tokens (all the vocabulary check reads)."""
    path.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(VOCAB)}},
                                "added_tokens": []}))
    return str(path)


def model_section(family: str, tokenizer_path: str) -> dict:
    keys = {**H.TINY["llama"], "num_layers": CH.NUM_LAYERS, **FAMILIES[family]}
    keys.pop("vocab_size")
    return {**keys, "make_vocab_size_divisible_by": 1, "encoder_seq_length": H.SEQ,
            "optim": {"name": "adamw", **H.OPTIM}, "tokenizer": {"library": "huggingface", "model": tokenizer_path}}


def model_config(family: str) -> ModelConfig:
    return H.tiny_config("llama", num_layers=CH.NUM_LAYERS, **FAMILIES[family])


def _train_and_save(family: str, tp: int, pp: int, directory: str, section: dict) -> dict:
    cfg = model_config(family)
    original = H.tiny_config
    H.tiny_config = lambda arch, **kw: cfg  # CH.build's model: this family's
    try:
        cfg, topo, model, optimizer = CH.build("llama", CH.L(tp=tp, pp=pp), seed=1234)
    finally:
        H.tiny_config = original
    for i in range(CH.STEPS):
        CH.step(cfg, topo, model, optimizer, i)
    ckpt = Checkpointer(directory, rank=dist.get_rank(), world_size=dist.get_world_size(), token="0",
                        async_save=False)
    ckpt.save(CH.STEPS, model, optimizer, topo, extra={"step": CH.STEPS, "data": {"consumed_samples": CONSUMED}},
              config={"model": section})
    dist.barrier()
    return {}


def our_checkpoint(tmp: Path, family: str, tp: int = 1, pp: int = 1) -> Path:
    """A checkpoint directory of ours for `family`, trained and saved at tp x pp (x dp 1)."""
    section = model_section(family, tokenizer(tmp / "tokenizer.json"))
    directory = tmp / f"ours_{family}_tp{tp}_pp{pp}"
    run_distributed(_train_and_save, tp * pp, (family, tp, pp, str(directory), section))
    return directory
