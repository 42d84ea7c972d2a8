# A reward model (runtime/alignment/reward.py) as a Hugging Face sequence-classification checkpoint: the decoder's
# weights under its family's names, written by hf.py's export, and the score head, our `output.weight` (1, hidden),
# as `score.weight`, the name LlamaForSequenceClassification, Qwen2ForSequenceClassification and
# GPT2ForSequenceClassification give their Linear(hidden, num_labels=1, bias=False). Those models score a row at its
# last token that is not padding, so config.json carries pad_token_id, and the architecture is the family's
# *ForCausalLM (GPT2LMHeadModel) renamed *ForSequenceClassification.
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.convert.hf import save_hf_directory
from runtime.schema.model import ModelConfig

HEAD = "output.weight"  # the reward model's score head, (1, hidden)
HF_HEAD = "score.weight"
_HEAD_FILE = "model-score.safetensors"
_BODY_FILE = "model-body.safetensors"  # a single-file body, renamed so that transformers reads the index


def is_reward_model(training: Mapping, head_shape: tuple[int, ...] | None = None, hidden: int | None = None) -> bool:
    """Whether a checkpoint is a reward model's (the rlhf_rm stage's): its recorded config has the reward_model
    section, or (a config written without it) its output.weight is a score head, (1, hidden)."""
    return isinstance(training.get("reward_model"), Mapping) or (head_shape is not None and
                                                                 tuple(head_shape) == (1, hidden))


def sequence_classification_architecture(causal_lm: str) -> str:
    """LlamaForCausalLM -> LlamaForSequenceClassification, GPT2LMHeadModel -> GPT2ForSequenceClassification."""
    for suffix in ("ForCausalLM", "LMHeadModel"):
        if causal_lm.endswith(suffix):
            return causal_lm.removesuffix(suffix) + "ForSequenceClassification"
    raise ValueError(f"no sequence-classification counterpart known for the architecture {causal_lm!r}")


def _body_config(cfg: ModelConfig) -> ModelConfig:
    # Exported as a tied model, whose writer stores no output head: the score head is written apart.
    return dataclasses.replace(cfg, share_embeddings_and_output_weights=True)


def _classifier_config(config: dict, pad_token_id: int | None) -> dict:
    """An exported causal LM's config.json dict -> its sequence-classification form with one label."""
    if pad_token_id is None:
        pad_token_id = config.get("pad_token_id")
    if pad_token_id is None:
        raise ValueError("pad_token_id: a reward model's export needs the padding id (transformers scores each row "
                         "at its last token that is not padding); pass it, or a tokenizer with a pad token")
    architecture = sequence_classification_architecture(config["architectures"][0])
    return {**config, "architectures": [architecture], "num_labels": 1, "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}, "pad_token_id": int(pad_token_id), "tie_word_embeddings": False}


class _Body(Mapping):
    """A full state without its score head; a lazy state stays lazy (its dtype goes along)."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state
        self.dtype = getattr(state, "dtype", None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == HEAD:
            raise KeyError(name)
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.state if name != HEAD)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _head(full_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if HEAD not in full_state:
        raise ValueError(f"the reward model's state has no {HEAD} (its score head)")
    head = full_state[HEAD]
    if tuple(head.shape) != (1, cfg.hidden_size):
        raise ValueError(f"{HEAD} is {tuple(head.shape)}, not a reward model's score head (1, {cfg.hidden_size})")
    return head


def save_reward_hf_directory(out_dir: str | os.PathLike, full_state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                             tokenizer_path: str | None = None, *, pad_token_id: int | None = None,
                             overwrite: bool = False, max_shard_bytes: int | None = None,
                             also: Callable[[Path], None] | None = None) -> Path:
    """A directory AutoModelForSequenceClassification loads: hf.py's (config.json, the body's safetensors,
    tokenizer files) with the score head in a safetensors file of its own and an index naming every tensor's file.
    pad_token_id: None takes the tokenizer's pad token. max_shard_bytes: hf.py's (None: its default). also: called
    with the directory before it is put in place (as hf.py's), after the head is written."""
    head = _head(full_state, cfg)
    dtype = getattr(full_state, "dtype", None) or full_state["embed.word.weight"].dtype

    def add_head(directory: Path) -> None:
        config_file = directory / "config.json"
        config = _classifier_config(json.loads(config_file.read_text(encoding="utf-8")), pad_token_id)
        config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file({HF_HEAD: head.detach().to(dtype).contiguous()}, str(directory / _HEAD_FILE),
                  metadata={"format": "pt"})
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            index = json.loads(index_file.read_text(encoding="utf-8"))
        else:  # transformers reads model.safetensors before any index: the body moves to a file the index names
            (directory / "model.safetensors").rename(directory / _BODY_FILE)
            header = _safetensors_header(directory / _BODY_FILE)
            size = max((entry["data_offsets"][1] for entry in header.values()), default=0)
            index = {"metadata": {"total_size": size}, "weight_map": {name: _BODY_FILE for name in header}}
        index["weight_map"][HF_HEAD] = _HEAD_FILE
        index["metadata"]["total_size"] += head.numel() * dtype.itemsize
        index_file.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if also is not None:
            also(directory)

    body = dict(_Body(full_state)) if isinstance(full_state, dict) else _Body(full_state)  # a dict keeps its dtypes
    sharding = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return save_hf_directory(out_dir, body, _body_config(cfg), tokenizer_path, overwrite=overwrite, also=add_head,
                             **sharding)


def _safetensors_header(path: Path) -> dict:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets), read from its header alone."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header
