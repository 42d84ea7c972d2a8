"""One NxD Training file's keys, each to what it becomes: map_file's table of key handlers (launcher/nxdt_config.py
runs it). A key is refused when it is unsupported (launcher/nxdt_keys.py's UNSUPPORTED), else taken by the handler
of its own key (KEY_HANDLERS), else by the first of the tables' rules that holds it (TABLE_RULES), else it is
unknown and refused. Also the Mapping that the file becomes, and data.tokenizer, whose keys are read together.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.nemo_config import longest_prefix
from launcher.nxdt_keys import (DIFFERS, FINE_TUNING_MAPPED, FRACTIONS, GPT2_BPE, IGNORED, IMPLIES, MAPPED,
                                MEGATRON_SWITCHES, NEUTRAL, NULL_MEANS, OVER_CONFIG_JSON, RECOMPUTE_NEAREST,
                                SEQUENTIAL_MOVE_FACTOR, TOKENIZER_KEYS, UNSUPPORTED, WEIGHTS_FROM, flatten, put)


@dataclass
class Mapping:
    """What one NxD Training file becomes."""

    source: Path
    training: dict[str, Any]                  # the stage's config (a defaults list + our keys)
    cluster: dict[str, Any]                   # cluster.* overrides (the Neuron compiler keys)
    rows: list[tuple[str, Any, str]] = field(default_factory=list)   # (key in the file, value, what became of it)
    dialect: str = "NxD Training"
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stage: str = "training"                   # the stage it configures: training | fine_tuning | peft | alignment
    stage_reason: str = ""                    # which of its keys says so

    @property
    def name(self) -> str:
        """The Hydra choice it is registered under: stable for a given file content."""
        digest = hashlib.sha256(repr(sorted(flatten(self.training).items())).encode()).hexdigest()[:10]
        stem = re.sub(r"\W", "_", self.source.stem)  # a plain Hydra choice name, whatever the file is called
        return f"_imported_{stem}_{digest}"


@dataclass
class FileKeys:
    """One NxD Training file's keys on their way into its Mapping: what every key handler reads and writes."""

    at: str                                   # `<group>=@<path>`: how errors and warnings name the file
    path: str
    stage: str                                # the stage it configures
    flat: dict[str, Any]                      # the file's keys, dotted
    weights: bool                             # a fine-tuning file that starts from weights (model.weight_init_only)
    result: Mapping
    training: dict[str, Any] = field(default_factory=dict)   # our keys, nested, without the stage's name

    def put(self, target: str, value: Any) -> None:
        """`training.<key>` into the stage's config, `cluster.<key>` into the cluster overrides."""
        if target.startswith("cluster."):
            put(self.result.cluster, target[len("cluster."):], value)
        else:
            put(self.training, target[len("training."):], value)

    def row(self, key: str, value: Any, what: str) -> None:
        self.result.rows.append((key, value, what))

    def error(self, message: str) -> None:
        self.result.errors.append(f"{self.at}: {message}")

    def warn(self, message: str) -> None:
        self.result.warnings.append(f"{self.at}: {message}")

    def refuse(self, key: str, value: Any, message: str, why: str) -> None:
        self.error(message)
        self.row(key, value, "refused: " + why)


# A handler maps one key of the file and returns True, or returns False to leave it to the tables' rules.
Handler = Callable[[FileKeys, str, Any], bool]


def map_keys(file: FileKeys) -> None:
    """Every key of the file: data.tokenizer's together, then each of the others on its own."""
    tokenizer, rows, warnings, errors = _map_tokenizer(file.flat, file.at)
    if tokenizer:
        file.training.setdefault("model", {})["tokenizer"] = tokenizer
    file.result.rows += rows
    file.result.warnings += warnings
    file.result.errors += errors
    for key, value in file.flat.items():
        map_key(file, key, value)


def map_key(file: FileKeys, key: str, value: Any) -> None:
    """Unsupported (unless its value is the default here), else its own handler's, else the first table rule's that
    takes it, else unknown."""
    top = longest_prefix(key, UNSUPPORTED)
    if top is not None and NEUTRAL.get(key, object()) != value:
        file.refuse(key, value, f"{key} is not supported: {UNSUPPORTED[top]}", UNSUPPORTED[top])
        return
    handler = KEY_HANDLERS.get(key)
    if handler is not None and handler(file, key, value):
        return
    if any(rule(file, key, value) for rule in TABLE_RULES):
        return
    file.row(key, value, "unknown")
    file.error(f"{key} is not an NxD Training key nxdt-launch knows; remove it "
               f"(`nxdt-launch explain-config {file.path}` lists every key and what it maps to)")


# --- the keys with a rule of their own --------------------------------------------------------------------------------

def _tokenizer_key(file: FileKeys, key: str, value: Any) -> bool:
    return True  # _map_tokenizer's


def _sequential_move_factor(file: FileKeys, key: str, value: Any) -> bool:
    """A positive integer, as NxD requires, is ignored (IGNORED says why); anything else is refused."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return False
    file.refuse(key, value, f"{key}: {value!r} must be a positive integer (the ranks NxD Training moves to the "
                            f"device at a time), e.g. {key}: 11; or leave it out, it changes nothing here",
                "not a positive integer")
    return True


def _fine_tuning_file(file: FileKeys, key: str, value: Any) -> bool:
    """A fine-tuning file's chat files (data.train_dir, val_dir) and starting weights (with weight_init_only)."""
    if file.stage == "training" or not (key in FINE_TUNING_MAPPED or (file.weights and key == WEIGHTS_FROM)):
        return False
    target = FINE_TUNING_MAPPED.get(key, "training.model.restore_from_path")
    converted = value if key == WEIGHTS_FROM or value is None or isinstance(value, list) else [value]
    if key == "data.val_dir" and value is None:
        converted = []  # NxD's val_dir: null is no validation files
    file.put(target, converted)
    file.row(key, value, target if converted == value else f"{target} = {converted!r}")
    return True


def _encoder_seq_length(file: FileKeys, key: str, value: Any) -> bool:
    """NxD's SFT files train on data.seq_length and keep the model's own length for its positions."""
    if file.flat.get("data.seq_length") in (None, value):
        return False
    file.row(key, value, f"ignored: sequences are data.seq_length ({file.flat['data.seq_length']}) long; positions "
                         f"come from max_position_embeddings (config.json's, with model_config)")
    return True


def _max_position_embeddings(file: FileKeys, key: str, value: Any) -> bool:
    """NxD Training's files set it for their RoPE table (Mixtral's to encoder_seq_length, under config.json's
    32768); here config.json decides every key, and a table of either length computes the same rows."""
    if file.flat.get("model.model_config") is None:
        return False
    file.row(key, value, "ignored: model_config's config.json decides max_position_embeddings (the RoPE table's "
                         "length; every row of encoder_seq_length computes the same)")
    return True


def _megatron_switch(file: FileKeys, key: str, value: Any) -> bool:
    file.row(key, value, "with the other switches: training.model.architecture")
    return True


def _sliding_window_size(file: FileKeys, key: str, value: Any) -> bool:
    if (problem := _sliding_window(value, file.flat)) is not None:
        file.error(f"{key}: {problem}")
    file.row(key, value, f"refused: {problem}" if problem else
             "the default here: no sequence is longer than the window")
    return True


def _compiler_cache_url(file: FileKeys, key: str, value: Any) -> bool:
    """NxD resolves a relative cache in the job's working directory; the shared results root is the one every node
    sees."""
    if not _is_relative(value):
        return False
    relative = value.removeprefix("./")
    file.put("cluster.neuron.compile.cache", f"${{base_results_dir}}/{relative}")
    file.row(key, value, f"cluster.neuron.compile.cache = '<base_results_dir>/{relative}'")
    file.warn(f"{key}: {value!r} is relative; NxD Training resolves it in the job's working directory, and the cache "
              f"must be a directory every node sees: it becomes <base_results_dir>/{relative} "
              f"(cluster.neuron.compile.cache), which the nodes share and later runs reuse; set "
              f"cluster.neuron.compile.cache to place it elsewhere")
    return True


def _recompute(file: FileKeys, key: str, value: Any) -> bool:
    """NxD's recompute modules with no module of that extent here become the nearest (RECOMPUTE_NEAREST)."""
    if not isinstance(value, list) or not any(m in RECOMPUTE_NEAREST for m in value):
        return False
    modules = list(dict.fromkeys(RECOMPUTE_NEAREST.get(m, (m,))[0] for m in value if
                                 RECOMPUTE_NEAREST.get(m, (m,))[0] is not None))
    file.put("training.model.activations_checkpoint_recompute", modules)
    file.row(key, value, f"training.model.activations_checkpoint_recompute = {modules!r}")
    for module in (m for m in value if m in RECOMPUTE_NEAREST):
        file.warn(f"{key}: {module}: {RECOMPUTE_NEAREST[module][1]}")
    return True


def _weight_init_only(file: FileKeys, key: str, value: Any) -> bool:
    file.row(key, value, f"with {WEIGHTS_FROM}: training.model.restore_from_path" if value else "the default here")
    return True


# key -> its handler, consulted before the tables' rules (a handler that returns False passes the key on to them).
KEY_HANDLERS: dict[str, Handler] = {
    **{key: _tokenizer_key for key in TOKENIZER_KEYS},
    SEQUENTIAL_MOVE_FACTOR: _sequential_move_factor,
    **{key: _fine_tuning_file for key in (*FINE_TUNING_MAPPED, WEIGHTS_FROM)},
    "model.encoder_seq_length": _encoder_seq_length,
    "model.max_position_embeddings": _max_position_embeddings,
    **{key: _megatron_switch for key in MEGATRON_SWITCHES},
    "model.sliding_window_size": _sliding_window_size,
    "compiler_cache_url": _compiler_cache_url,
    "model.activations_checkpoint_recompute": _recompute,
    "model.weight_init_only": _weight_init_only,
}


# --- the tables' rules, in the order they are asked -------------------------------------------------------------------

def _null_means(file: FileKeys, key: str, value: Any) -> bool:
    if key not in NULL_MEANS or value is not None:
        return False
    file.put(MAPPED[key], None)
    file.row(key, value, f"{MAPPED[key]} = None: {NULL_MEANS[key]}")
    return True


def _mapped_null(file: FileKeys, key: str, value: Any) -> bool:
    if key not in MAPPED or value is not None:
        return False
    file.row(key, value, "null: the base recipe's value stays")
    return True


def _fraction(file: FileKeys, key: str, value: Any) -> bool:
    if key not in FRACTIONS or not isinstance(value, float) or value == 0:
        return False
    file.refuse(key, value, f"{key}: {value!r} is a fraction of an epoch (PyTorch Lightning's float form); "
                            f"nxdt-launch counts steps: give a whole number", "a fraction of an epoch")
    return True


def _over_config_json(file: FileKeys, key: str, value: Any) -> bool:
    if key not in OVER_CONFIG_JSON or file.flat.get("model.model_config") is None:
        return False
    if value == -1:  # NxD's "not set"
        file.row(key, value, "-1: config.json's value stays")
    else:
        target = f"training.model.model_config_overrides.{OVER_CONFIG_JSON[key]}"
        file.put(target, value)
        file.row(key, value, f"{target}: applied over config.json, as NxD Training does")
    return True


def _mapped(file: FileKeys, key: str, value: Any) -> bool:
    if key not in MAPPED:
        return False
    file.put(MAPPED[key], value)
    file.row(key, value, MAPPED[key])
    return True


def _implied(file: FileKeys, key: str, value: Any) -> bool:
    """The value's meaning, said with another key; map_file applies it after the file's own keys."""
    if key not in IMPLIES or value != IMPLIES[key][0]:
        return False
    _, target, implied, why = IMPLIES[key]
    file.row(key, value, f"{target} = {implied!r}: {why}")
    return True


def _neutral(file: FileKeys, key: str, value: Any) -> bool:
    if key not in NEUTRAL:
        return False
    file.row(key, value, "the default here")
    return True


def _ignored(file: FileKeys, key: str, value: Any) -> bool:
    if (ignored := longest_prefix(key, IGNORED)) is None:
        return False
    file.row(key, value, "ignored: " + IGNORED[ignored])
    return True


def _differs(file: FileKeys, key: str, value: Any) -> bool:
    if key not in DIFFERS:
        return False
    expected, why = DIFFERS[key]
    file.row(key, value, "the default here" if value != expected else f"differs: {why}")
    if value == expected:
        file.warn(f"{key}: {value!r} is ignored: {why}")
    return True


TABLE_RULES: tuple[Handler, ...] = (_null_means, _mapped_null, _fraction, _over_config_json, _mapped, _implied,
                                    _neutral, _ignored, _differs)


# --- what a handler asks ----------------------------------------------------------------------------------------------

def _sliding_window(window: Any, flat: dict[str, Any]) -> str | None:
    """NxD masks keys more than `window` positions back: nothing, when no sequence is longer than the window."""
    seq = flat.get("data.seq_length") or flat.get("model.encoder_seq_length")
    if window is None or (isinstance(seq, int) and isinstance(window, int) and window >= seq):
        return None
    return (f"{window!r}: a megatron model here attends to the whole sequence (sliding windows are built only in the "
            f"families whose config.json has them); a window below the sequence length ({seq}) changes the "
            f"attention: set it to null")


def _is_relative(path: Any) -> bool:
    """A local path NxD resolves in the job's working directory (not absolute, no URL, no ~ or $ to expand)."""
    return isinstance(path, str) and bool(path) and not path.startswith(("/", "~", "$")) and "://" not in path


# --- data.tokenizer, whose keys are read together ---------------------------------------------------------------------

def _map_tokenizer(flat: dict[str, Any], at: str) -> tuple[dict[str, Any], list, list[str], list[str]]:
    """NxD's data.tokenizer -> our model.tokenizer (one Hugging Face tokenizer.json): (our keys, rows, warnings,
    errors). type names the tokenizer's directory, for NeMo's huggingface library and its megatron library alike
    (which loads a name it does not know as a Hugging Face tokenizer); the megatron library's GPT2BPETokenizer is
    GPT-2's BPE from vocab_file + merge_file, which one tokenizer.json holds too."""
    ours: dict[str, Any] = {}
    rows, warnings, errors = [], [], []
    library, kind = flat.get("data.tokenizer.library"), flat.get("data.tokenizer.type")
    if library in ("huggingface", "megatron"):
        ours["library"] = "huggingface"
        rows.append(("data.tokenizer.library", library, "training.model.tokenizer.library = 'huggingface'"
                     + ("" if library == "huggingface" else ": the tokenizer data.tokenizer.type names, as a "
                                                           "tokenizer.json")))
    elif "data.tokenizer.library" in flat:
        errors.append(f"{at}: data.tokenizer.library: {library!r} is not read here; nxdt-launch reads a Hugging Face "
                      f"tokenizer.json: set it to huggingface and data.tokenizer.type to the tokenizer's directory")
    pair = {key: flat.get(f"data.tokenizer.{key}") for key in ("vocab_file", "merge_file")}
    if kind == GPT2_BPE:
        if None in pair.values():
            errors.append(f"{at}: data.tokenizer.type: {GPT2_BPE} is GPT-2's BPE, built from data.tokenizer.vocab_file "
                          f"and merge_file; set both (GPT-2's vocab.json and merges.txt)")
            return ours, rows, warnings, errors
        ours["model"] = str(Path(str(pair["vocab_file"])).parent / "tokenizer.json")
        rows.append(("data.tokenizer.type", kind, f"with vocab_file and merge_file: training.model.tokenizer.model = "
                                                  f"{ours['model']!r}"))
        rows += [(f"data.tokenizer.{key}", value, "with type: training.model.tokenizer.model")
                 for key, value in pair.items()]
        warnings.append(f"{at}: data.tokenizer: GPT-2's BPE ({pair['vocab_file']} + {pair['merge_file']}) is read "
                        f"here as one tokenizer.json, training.model.tokenizer.model = {ours['model']} (beside "
                        f"vocab_file): write it there (a data_preparation stage with tokenizer.vocab_file and "
                        f"merge_file writes one) or point training.model.tokenizer.model at one")
        return ours, rows, warnings, errors
    if kind is not None:
        ours["model"] = _tokenizer_json(kind)
        rows.append(("data.tokenizer.type", kind, f"training.model.tokenizer.model = {ours['model']!r}"))
    elif "data.tokenizer.type" in flat:
        rows.append(("data.tokenizer.type", kind, "null: the base recipe's value stays"))
    for key, value in pair.items():
        if value is not None:
            errors.append(f"{at}: data.tokenizer.{key} is read only with data.tokenizer.type: {GPT2_BPE} (GPT-2's "
                          f"BPE); set it to null, or type to {GPT2_BPE}")
        elif f"data.tokenizer.{key}" in flat:
            rows.append((f"data.tokenizer.{key}", value, "the default here"))
    return ours, rows, warnings, errors


def _tokenizer_json(kind: Any) -> str:
    """NxD names the tokenizer's directory; we read its tokenizer.json."""
    path = Path(str(kind))
    return str(path if path.suffix == ".json" else path / "tokenizer.json")
