# Conversion between the runtime's full (unsharded) state dict and Hugging Face checkpoints of every supported
# family (runtime/families, through the registry runtime/schema/families): export a trained model to HF tools, or
# start training from an HF model. The families' config.json mapping and weight names are theirs (each
# architecture's `weights` module, with each MoE family's expert names as transformers saves them on disk); a
# family's older or fused in-memory names (its normalized_state) import too.
# Only renames, transposes, splits and concatenations touch the tensors (no arithmetic, no dtype change), so a
# round trip is bitwise lossless. transformers is deliberately not imported: only its file format is needed.
# Here: the whole state both ways (to_hf, from_hf) and the directories (save_hf_directory, load_hf_directory); where
# each tensor lives is hf_layout.py's, and hf_slices.py reads a rank's slices of a directory.
from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

# The layout (hf_layout.py) and the sliced reader (hf_slices.py) are imported from here too, as they always were.
from runtime.convert.hf_layout import (_BUFFER, VOCAB_ROWS, _check_names, _hf_shapes, _join, _read_json,  # noqa: F401
                                       _Rule, _rules, _split, check_weight, pad_vocab, padded_rows, state_shapes,
                                       unpadded_state)
from runtime.convert.hf_slices import SlicedReader  # noqa: F401
from runtime.io.files import replace_directory
from runtime.schema.chat import chat_stop_ids, special_tokens, token_id
from runtime.schema.families import export_family, family_of_model_type
from runtime.schema.model import ModelConfig, hf_model_keys, tokenizer_vocab_size
from runtime.schema.safetensors_file import hf_weights_problems


# Our GeluMLP uses the tanh approximation; HF spells that two ways with identical math.
_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """Contiguous and alone in its storage: safetensors refuses tensors that share memory (split views)."""
    exclusive = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if tensor.is_contiguous() and exclusive else tensor.clone(memory_format=torch.contiguous_format)


def to_hf(full_state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """Our full state -> (HF state dict, config.json dict). Tied models store the embedding once; a padded
    vocabulary is cut back to the source's rows and vocab_size."""
    _check_exportable(cfg)
    full_state, cfg = unpadded_state(full_state, cfg)
    shapes, state = state_shapes(cfg), dict(full_state)
    tied = cfg.share_embeddings_and_output_weights
    output = state.pop("output.weight", None) if tied else None  # a tied model may list it or not
    if tied:
        del shapes["output.weight"]
    _check_names(state, shapes, "full state")
    for name, shape in shapes.items():
        if state[name].shape != shape:
            raise ValueError(f"full state {name} has shape {tuple(state[name].shape)}; the model config implies "
                             f"{tuple(shape)}")
    embedding = state["embed.word.weight"]
    if output is not None and output is not embedding and not torch.equal(output, embedding):
        raise ValueError("full state output.weight differs from embed.word.weight although "
                         "model.share_embeddings_and_output_weights is true")
    hf: dict[str, torch.Tensor] = {}
    for rule in _rules(cfg):
        hf.update({name: _own(part) for name, part in zip(rule.hf, _split(rule, state[rule.ours]), strict=True)})
    return hf, _hf_config(cfg, embedding.dtype)


def _check_exportable(cfg: ModelConfig) -> None:
    export_family(cfg)  # ValueError naming the key when no family computes cfg exactly


def _tied_head(cfg: ModelConfig, name: str) -> bool:
    """A tied model's output.weight: the embedding under a second name, which HF stores once."""
    return cfg.share_embeddings_and_output_weights and name == "output.weight"


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    common = {"vocab_size": cfg.vocab_size,  # the rows written: a source's own, our padding cut (unpadded_state)
              "tie_word_embeddings": cfg.share_embeddings_and_output_weights, "initializer_range": cfg.init_method_std,
              "bos_token_id": None, "eos_token_id": None,  # save_hf_directory fills these from the tokenizer
              "torch_dtype": str(dtype).removeprefix("torch.")}
    return {**export_family(cfg).hf_config(cfg), **common}


def from_hf(hf_state: dict[str, torch.Tensor], hf_config: dict, *,
            tokenizer_vocab_size: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """HF state dict + config.json dict -> (our full state, the `model:` keys that rebuild the model).

    The keys give `ModelConfig.from_model_section(keys, tokenizer_vocab_size)` exactly HF's vocab_size: their
    make_vocab_size_divisible_by pads the tokenizer's size (when known; else HF's vocab_size) up to it.
    """
    keys = hf_model_keys(hf_config, tokenizer_vocab_size)
    vocab = int(hf_config["vocab_size"])
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size or vocab)
    assert cfg.vocab_size == vocab, (cfg.vocab_size, vocab)
    state = _normalized_hf_state(hf_state, hf_config["model_type"], cfg.share_embeddings_and_output_weights)
    rules, shapes = _rules(cfg), state_shapes(cfg)
    _check_names(state, {name: None for rule in rules for name in rule.hf}, "HF state")
    ours: dict[str, torch.Tensor] = {}
    for rule in rules:
        for name, shape in zip(rule.hf, _hf_shapes(rule, shapes[rule.ours]), strict=True):
            if state[name].shape != shape:
                raise ValueError(f"HF tensor {name} has shape {tuple(state[name].shape)}; config.json implies "
                                 f"{tuple(shape)}")
        ours[rule.ours] = _join(rule, [state[name] for name in rule.hf])
    if cfg.share_embeddings_and_output_weights:
        ours["output.weight"] = ours["embed.word.weight"]  # as build_model(cfg).state_dict() names it
    return ours, keys


def _normalized_hf_state(hf_state: dict[str, torch.Tensor], model_type: str, tied: bool) -> dict[str, torch.Tensor]:
    """Names as transformers 4.x/5.x save them (a family's older forms renamed by its normalized_state): drops
    non-parameter buffers and a tied lm_head copy."""
    family = family_of_model_type(model_type)
    state = dict(hf_state)
    if hasattr(family, "normalized_state"):  # a family's older or fused names -> those its weight rules use
        state = family.normalized_state(state)
    state = {k: v for k, v in state.items() if not _BUFFER.match(k)}
    embedding = state.get(getattr(family, "EMBEDDING", "model.embed_tokens.weight"))
    if tied and "lm_head.weight" in state and embedding is not None:
        if not torch.equal(state.pop("lm_head.weight"), embedding):
            raise ValueError("lm_head.weight differs from the token embedding although config.json "
                             "tie_word_embeddings is true")
    return state


# ---- Directories: config.json, safetensors (sharded like transformers), tokenizer files ----

def save_hf_directory(out_dir: str | os.PathLike, full_state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                      tokenizer_path: str | None, *, overwrite: bool = False,
                      max_shard_bytes: int = _SHARD_BYTES, also: Callable[[Path], None] | None = None) -> Path:
    """Write a directory `from_pretrained` loads. It appears whole or not at all (written beside, then renamed);
    `also(directory)` adds more files to it before it appears. `full_state` may be lazy (a Mapping that
    assembles each tensor when it is read, as the conversion stage's export passes): each is read once."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out_dir {str(out)!r} is not empty; pass overwrite=True to replace it")
    _check_exportable(cfg)
    full_state, cfg = unpadded_state(full_state, cfg)
    _check_names({n: None for n in full_state.keys() if not _tied_head(cfg, n)},
                 {n: None for n in state_shapes(cfg) if not _tied_head(cfg, n)}, "full state")
    dtype = getattr(full_state, "dtype", None) or full_state["embed.word.weight"].dtype
    if cfg.share_embeddings_and_output_weights and isinstance(full_state, dict) and "output.weight" in full_state:
        output, embedding = full_state["output.weight"], full_state["embed.word.weight"]
        if output is not embedding and not torch.equal(output, embedding):
            raise ValueError("full state output.weight differs from embed.word.weight although "
                             "model.share_embeddings_and_output_weights is true")
    config = _hf_config(cfg, dtype)
    tokenizer = _read_json(Path(tokenizer_path), "tokenizer_path") if tokenizer_path else None
    # The source's own tokenizer_config.json (a Hugging Face model's, or data_preparation's) says best what its
    # special tokens are, and holds the chat template: an export carries both.
    source_config = _source_tokenizer_config(Path(tokenizer_path)) if tokenizer_path else {}
    specials = special_tokens(tokenizer, source_config) if tokenizer else {}
    for key, token in specials.items():
        if key in ("bos_token", "eos_token", "pad_token"):
            config[key + "_id"] = token_id(tokenizer, token)
    generation = _generation_config(config, Path(tokenizer_path) if tokenizer_path else None, source_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from everyone else on a shared filesystem
        _write_json(tmp / "config.json", config)
        _write_weights(tmp, cfg, full_state, dtype, max_shard_bytes)
        if tokenizer_path:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
            template = {"chat_template": source_config["chat_template"]} if source_config.get("chat_template") else {}
            _write_json(tmp / "tokenizer_config.json", {
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
                "clean_up_tokenization_spaces": False, **specials, **template})
            if generation:
                _write_json(tmp / "generation_config.json", generation)
        if also is not None:
            also(tmp)
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _write_weights(directory: Path, cfg: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   max_shard_bytes: int) -> None:
    """Our tensors -> HF safetensors files (sharded like transformers, with an index), written tensor by tensor:
    every file's header is known from the config's shapes before any tensor is read, so each of our tensors is
    read from `state` once (a lazy mapping assembles it then), split into its HF parts, written at its offsets
    and dropped. Peak memory is one of our tensors and its parts, not the model. safetensors' own writer takes a
    whole file's tensors at once, hence this one (the format: safetensors_file.py); safe_open and transformers
    read its files (tests/convert/test_sharded_weights.py holds them against save_file's, tensor for tensor)."""
    shapes = state_shapes(cfg)
    # A plain dict may mix dtypes (a base that keeps its norms in fp32): each tensor keeps its own. A lazy mapping
    # (a checkpoint) is read as one dtype, the header being written before any of it is read.
    dtypes = {name: tensor.dtype for name, tensor in state.items()} if isinstance(state, dict) else {}
    shards: list[list[tuple[_Rule, list[tuple[str, tuple]]]]] = [[]]
    size = 0
    for rule in _rules(cfg):
        width = dtypes.get(rule.ours, dtype).itemsize
        parts = [(name, tuple(shape)) for name, shape in zip(rule.hf, _hf_shapes(rule, shapes[rule.ours]))]
        nbytes = sum(math.prod(shape) * width for _, shape in parts)
        if shards[-1] and size + nbytes > max_shard_bytes:  # a rule's parts stay in one file
            shards.append([])
            size = 0
        shards[-1].append((rule, parts))
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0  # transformers checks for the format
        for rule, parts in shard:
            kind = dtypes.get(rule.ours, dtype)
            for name, shape in parts:
                end = offset + math.prod(shape) * kind.itemsize
                header[name] = {"dtype": _DTYPES[kind], "shape": list(shape), "data_offsets": [offset, end]}
                offset = end
                weight_map[name] = file
        total += offset
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(directory / file, "wb") as out:
            out.write(len(text).to_bytes(8, "little") + text)
            for rule, parts in shard:
                tensor = state[rule.ours]
                want = dtypes.get(rule.ours, dtype)
                if tuple(tensor.shape) != tuple(shapes[rule.ours]) or tensor.dtype != want:
                    raise ValueError(f"full state {rule.ours} is {tuple(tensor.shape)} {tensor.dtype}; the model "
                                     f"config implies {tuple(shapes[rule.ours])} {want}")
                for part in _split(rule, tensor):
                    out.write(part.contiguous().view(torch.uint8).numpy())  # the bytes, without a copy
                del tensor
    if len(files) > 1:
        _write_json(directory / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                                 "weight_map": weight_map})


def _generation_config(config: dict, tokenizer_path: Path | None, source_config: dict) -> dict:
    """The export's generation_config.json. From a Hugging Face source (a generation_config.json beside its
    tokenizer.json): the source's, whole (sampling defaults, max length, its list of stop ids in its order), with
    the chat template's end-of-turn ids it lacks appended. Otherwise: the tokenizer's bos / eos / pad ids, eos
    replaced by the chat template's end-of-turn ids when the tokenizer holds a chat template."""
    ours = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    stops = chat_stop_ids(tokenizer_path, source_config) if tokenizer_path else []
    beside = tokenizer_path.parent / "generation_config.json" if tokenizer_path else None
    if beside is None or not beside.is_file():
        if stops:
            ours["eos_token_id"] = stops if len(stops) > 1 else stops[0]
        return ours
    source = _read_json(beside, "generation_config.json")
    source.pop("transformers_version", None)  # the writer's version, not a setting
    eos = source.get("eos_token_id", ours.get("eos_token_id"))
    eos = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    eos += [i for i in stops if i not in eos]
    generation = {**ours, **source}
    if eos:
        generation["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return generation


def _source_tokenizer_config(tokenizer_path: Path) -> dict:
    """The tokenizer_config.json beside a tokenizer.json, or {} when there is none."""
    beside = tokenizer_path.parent / "tokenizer_config.json"
    return _read_json(beside, "tokenizer_config.json") if beside.is_file() else {}


def load_hf_directory(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, str | None]:
    """An HF model directory -> (our full state, our `model:` keys, its tokenizer.json or None)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{str(directory)!r} is not a directory (expected a Hugging Face model directory)")
    config = _read_json(directory / "config.json", "config.json")
    tokenizer = directory / "tokenizer.json"
    tokenizer_vocab = tokenizer_vocab_size(tokenizer) if tokenizer.is_file() else None
    state, keys = from_hf(_read_weights(directory), config, tokenizer_vocab_size=tokenizer_vocab)
    return state, keys, str(tokenizer) if tokenizer.is_file() else None


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, a sharded safetensors index, or the older pytorch_model.bin (single or sharded)."""
    problems = hf_weights_problems(directory)  # headers only, before any tensor is read
    if problems:
        raise ValueError(f"{problems[0]}; re-download it or use a complete copy")

    def safetensors_load(file: Path) -> dict[str, torch.Tensor]:
        try:
            return load_file(file)
        except SafetensorError as error:  # what the header check cannot see (the file changed since, say)
            raise ValueError(f"{file}: not a readable safetensors file ({error})") from None

    def torch_load(file: Path) -> dict[str, torch.Tensor]:
        fix = "convert it to safetensors where it was made, or give the model's real weights"
        try:  # weights_only: the pickle may rebuild tensors and plain containers, never run code
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise ValueError(f"{file}: holds Python objects other than tensors, which torch.load(weights_only=True) "
                             f"refuses to run; {fix}") from None
        except (RuntimeError, EOFError, OSError) as error:
            raise ValueError(f"{file}: not a readable PyTorch checkpoint ({' '.join(str(error).split())[:200]}); "
                             f"re-download it or {fix}") from None
        if not isinstance(state, dict):
            raise ValueError(f"{file}: holds a {type(state).__name__}, not a state dict of tensors; {fix}")
        return state

    def checked(file: Path, load) -> dict[str, torch.Tensor]:
        state = load(file)
        for name, tensor in state.items():
            if not _BUFFER.match(name):
                check_weight(name, tensor, file)
        return state

    for single, index, load in [("model.safetensors", "model.safetensors.index.json", safetensors_load),
                                ("pytorch_model.bin", "pytorch_model.bin.index.json", torch_load)]:
        if (directory / single).is_file():
            return checked(directory / single, load)
        if (directory / index).is_file():
            weight_map = _read_json(directory / index, index).get("weight_map", {})
            state: dict[str, torch.Tensor] = {}
            for file in sorted(set(weight_map.values())):
                state.update(checked(directory / file, load))
            return state
    raise AssertionError(f"{directory}: hf_weights_problems found weights that are not there")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
