"""The model's shape in a training stage config: the typed model keys, with those a Hugging Face config.json
supplies filled in (runtime/schema/training_hf.py says which config.json), the tokenizer's path and vocabulary,
the keys under model that nothing reads, and the shape's rules against the parallel layout."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.model import hf_model_keys, read_hf_config, tokenizer_vocab_size
from runtime.schema.reader import REQUIRED, Report, Section
from runtime.schema.training_config import ParallelConfig
from runtime.schema.training_files import Files, is_remote
from runtime.schema.training_hf import config_overrides, disagreements, model_config_source
from runtime.schema.training_model_parts import parse_latent_attention, parse_moe, parse_rope_scaling

_SHAPE_INTS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")


def model_shape(model: Section, p: str, report: Report, files: Files,
                known_vocab: int | None = None) -> tuple[dict, int | None, str]:
    """The typed model keys, with those a Hugging Face config.json supplies filled in, the tokenizer's vocabulary
    size (None when the file cannot be read here) and the tokenizer's path.

    The config.json is model.model_config (NxD Training's key) or, without one, that of the Hugging Face directory
    model.restore_from_path names: the model a run starts from decides its architecture and every shape and
    numeric constant. A key of the YAML that says otherwise is refused, naming both values (NxD Training lets the
    YAML win, which silently trains a different model than the one whose weights are loaded)."""
    source, source_key = model_config_source(model)
    hf_keys, config_vocab = _read_config_json(model, source, source_key, report, files)
    overrides = config_overrides(model, hf_keys, source, report)
    report.error(disagreements(model, {**hf_keys, **overrides} if hf_keys else {}, source, source_key))
    shape_known = _shape_known(model, source, source_key, hf_keys, report)
    merged = {**{k: v for k, v in hf_keys.items() if k != "make_vocab_size_divisible_by"}, **overrides,
              **{k: v for k, v in model.data.items() if v is not None}}
    if isinstance(hf_keys.get("moe"), dict) and isinstance(model.data.get("moe"), dict):
        merged["moe"] = {**hf_keys["moe"], **model.data["moe"]}  # key by key: a YAML key keeps the others
    keys = _typed_keys(Section(merged, model.path, report), merged, shape_known)

    path, vocab = _tokenizer(model, source, source_key, p, files, known_vocab)
    if config_vocab is not None:
        if vocab is not None:
            report.error(rules.tokenizer_fits(vocab, config_vocab, p))
        vocab = config_vocab  # as NxD Training builds it: the embedding has config.json's vocab_size rows
        if not model.has("make_vocab_size_divisible_by"):
            keys["make_vocab_size_divisible_by"] = hf_keys["make_vocab_size_divisible_by"]
        # The YAML's make_vocab_size_divisible_by may pad those rows further: ours, masked, trimmed on export.
        keys["unpadded_vocab_size"] = config_vocab
    return keys, vocab, path


def _read_config_json(model: Section, source: str | None, source_key: str, report: Report,
                      files: Files) -> tuple[dict[str, Any], int | None]:
    """config.json's model keys and its vocab_size: ({}, None) where it is not read here (no config.json, files
    not looked at, a remote one), and what was read before a problem, which is named."""
    hf_keys: dict[str, Any] = {}
    if source is None or not files.checked or is_remote(source):
        return hf_keys, None
    try:
        hf_config = read_hf_config(str(source))
        hf_keys = hf_model_keys(hf_config)
        return hf_keys, int(hf_config["vocab_size"])
    except (ValueError, TypeError, ArithmeticError, KeyError) as error:
        if Path(str(source)).exists():
            message = str(error) if isinstance(error, ValueError) else f"a value has the wrong type ({error})"
            report.error(f"{model.key(source_key)}: {source}: {message.removeprefix(repr(str(source)) + ' ')}")
        elif source_key == "model_config":  # a missing restore_from_path is read_restore_from's to name
            files.problem(f"{model.key(source_key)}: {source} does not exist; point it at the model's "
                          f"Hugging Face config.json")
    return hf_keys, None


def _shape_known(model: Section, source: str | None, source_key: str, hf_keys: dict, report: Report) -> bool:
    """Whether the whole shape is here to check: the YAML's, config.json's, or the YAML's beside weights that are
    not on this machine."""
    # Without a config.json the YAML holds the whole shape; with one that cannot be read here (a dry run on a
    # laptop) only what the YAML holds is checked, and the rest at launch on the cluster.
    # Weights not here (a dry run elsewhere, a remote path, or a missing directory that read_restore_from names):
    # the YAML's shape, when it has one, is checked as the YAML states it.
    shape_known = (source is None or bool(hf_keys)
                   or (source_key == "restore_from_path" and model.has("architecture")))
    # A fine-tuning recipe that leaves the model to its starting weights (hf/sft_demo), given none: one line naming
    # the key to set, rather than every shape key's.
    if source is None and "restore_from_path" in model.data and not any(
            model.has(key) for key in ("architecture", *_SHAPE_INTS)):
        report.error(f"{model.key('restore_from_path')}: missing, and the YAML has no shape; point it at a Hugging "
                     f"Face model directory (its config.json decides the model), or set {model.key('model_config')}")
        shape_known = False
    return shape_known


def _typed_keys(shape: Section, merged: dict, shape_known: bool) -> dict[str, Any]:
    """The model keys of `merged` (config.json's under the YAML's), typed; those not set are left out."""
    keys: dict[str, Any] = {}
    if "encoder_seq_length" in merged or shape_known:
        keys["encoder_seq_length"] = shape.int("encoder_seq_length", minimum=1)
    elif "max_position_embeddings" in merged:
        keys["encoder_seq_length"] = shape.int("max_position_embeddings", minimum=1)
    seq = keys.get("encoder_seq_length")
    if shape_known:
        keys["architecture"] = shape.choice("architecture", C.ARCHITECTURES)
        for key in _SHAPE_INTS:
            keys[key] = shape.int(key, minimum=1)
    if seq is not None:
        keys["max_position_embeddings"] = shape.int("max_position_embeddings", seq, minimum=1)
    keys["make_vocab_size_divisible_by"] = shape.int("make_vocab_size_divisible_by", 128, minimum=1)
    keys["seed"] = read_seed(shape)
    for key in ("num_query_groups", "kv_channels", "sliding_window"):
        if merged.get(key) is not None:
            keys[key] = shape.int(key, minimum=1)
    if merged.get("layer_types") is not None:
        keys["layer_types"] = shape.strings("layer_types")
    for key in ("rotary_base", "local_rotary_base", "softmax_scale", "layernorm_epsilon", "init_method_std",
                *rules.DROPOUTS):
        if merged.get(key) is not None:
            keys[key] = shape.float(key, minimum=0.0)
    for key in ("share_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm"):
        if merged.get(key) is not None:
            keys[key] = shape.bool(key)
    keys["moe"] = parse_moe(shape)
    keys["rope_scaling"] = parse_rope_scaling(shape)
    keys["latent_attention"] = parse_latent_attention(shape)
    return {k: v for k, v in keys.items() if v is not None}


def _tokenizer(model: Section, source: str | None, source_key: str, p: str, files: Files,
               known_vocab: int | None) -> tuple[str, int | None]:
    """model.tokenizer: the tokenizer's path and its vocabulary (`known_vocab` when the caller knows it)."""
    tokenizer = model.section("tokenizer")
    tokenizer.choice("library", C.TOKENIZER_LIBRARIES, "huggingface")
    # With a config.json the vocabulary comes from it; the tokenizer is then only checked against it. Starting from
    # a Hugging Face directory, its own tokenizer is the default.
    beside = Path(source).parent / "tokenizer.json" if source is not None else None
    if beside is not None and (source_key == "restore_from_path" or beside.is_file()):
        path = tokenizer.str("model", str(beside))
    else:
        path = tokenizer.str("model", None if source is not None else REQUIRED) or ""
    vocab = known_vocab
    if vocab is None and path:
        vocab = read_tokenizer_vocab(path, p, files)
    if vocab is not None and known_vocab is None:
        model.report.error(rules.vocab_rows(vocab, tokenizer.key("model"), repr(path)))
    return path, vocab


def read_tokenizer_vocab(path: str, p: str, files: Files) -> int | None:
    """The one rule on model.tokenizer.model's file: its vocabulary, or None when it is not read here (on S3, made
    by this launch's data_preparation, not looked at). A file that is not a tokenizer.json is an error; one that
    does not exist is a problem by `files`: an error at launch, a warning in a dry run."""
    if is_remote(path) or not files.inputs_checked:
        return None
    try:
        return tokenizer_vocab_size(path)
    except ValueError as error:
        if Path(path).exists():
            files.report.error(f"{p}model.tokenizer.model: {error}")
        else:
            files.problem(f"{p}model.tokenizer.model: {path} does not exist; prepare it first (nxdt-launch "
                          f"stages=[data_preparation], or data_preparation in this launch's stages) or point it at "
                          f"a tokenizer.json")
    return None


def unknown_model_keys(model: Section, shape: dict, report: Report) -> None:
    """A key under model that nothing reads (`+training.model.zero_stage=3`) is a typo or another trainer's key:
    refused as Section.done refuses one, with the keys this stage reads (those its model shape reads included)."""
    # A null key is an unset one (a recipe's num_query_groups: null is GPT's multi-head attention).
    shape_read = Section({k: v for k, v in model.data.items() if v is not None}, model.path, report)
    shape_read.seen = set(model.seen) | set(shape)
    shape_read.done()


def read_seed(section: Section) -> int | None:
    value = section.int("seed", 1234)
    section.report.error(None if value is None else rules.seed(value, section.key("seed")))
    return value


def shape_rules(report: Report, p: str, shape: dict, parallel: ParallelConfig, vocab: int | None) -> None:
    tp = parallel.tp
    seq = shape.get("encoder_seq_length")
    if seq and shape.get("max_position_embeddings"):
        report.error(rules.positions(shape["max_position_embeddings"], seq, p))
    if shape.get("make_vocab_size_divisible_by"):
        problem = rules.vocab_tp(vocab, shape["make_vocab_size_divisible_by"], tp, p)
        if problem and vocab is None:
            report.warn(problem)  # only the tokenizer can decide; the node has it
        else:
            report.error(problem)
    for name in rules.DROPOUTS:
        if name in shape:
            report.error(rules.dropout(name, shape[name], p))
    if "hidden_size" not in shape:
        return  # model_config not readable here (a dry run): the shape is checked at launch
    heads = shape["num_attention_heads"]
    groups = shape.get("num_query_groups") or heads
    report.error(rules.head_size(shape["hidden_size"], heads, shape.get("kv_channels"), p))
    for problem in rules.llama_switches(shape.get("architecture"),
                                        {k: shape.get(k) for k in rules.MODEL_SWITCHES}, p):
        report.error(problem)
    report.error(rules.attention_layers(shape.get("layer_types"), shape.get("sliding_window"), shape["num_layers"], p))
    report.error(rules.heads_groups(heads, groups, p))
    report.error(rules.heads_tp(heads, tp, p))
    report.error(rules.ffn_tp(shape["ffn_hidden_size"], tp, p))
    if heads % groups == 0:
        report.error(rules.kv_heads_tp(groups, tp, p))
    report.error(rules.layers_split(shape["num_layers"], parallel.pp, parallel.virtual_pp, p, parallel.pipeline_cuts))
    moe = shape.get("moe")
    if moe is not None:
        for problem in rules.moe(shape.get("architecture"), moe.num_experts, moe.top_k, moe.frequency,
                                 shape["num_layers"], moe.capacity_factor, moe.router_activation, p,
                                 layers=moe.layers, ffn=moe.ffn_hidden_size, ffn_dropout=shape.get("ffn_dropout"),
                                 groups=(moe.groups, moe.top_groups)):
            report.error(problem)
        if moe.ffn_hidden_size:
            report.error(rules.ffn_tp(moe.ffn_hidden_size, tp, p, "moe.ffn_hidden_size"))
        report.error(rules.bias_update(moe.router_bias_update_rate, moe.score_bias, p))
