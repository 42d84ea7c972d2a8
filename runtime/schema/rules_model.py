"""The model's shape rules: head sizes and groups against tensor parallelism, the keys only some architectures
compute, attention layer patterns, RoPE scaling, the vocabulary (padded_vocab_size, the one owner of the padding),
positions and dropouts. Rules as runtime/schema/rules.py describes them; callers use them as rules.<name>."""
from __future__ import annotations

import math

from runtime.schema.families import ARCHITECTURES, known_architecture


# ------------------------------------------------------------------------------------------------------- shape
def head_size(hidden: int, heads: int, kv_channels: int | None, p: str) -> str | None:
    """The head size: hidden / heads unless model.kv_channels sets it apart (Qwen3); RoPE rotates channel pairs."""
    if kv_channels is None:
        if hidden % heads == 0:
            return None
        return f"{p}model.hidden_size: {hidden} is not divisible by num_attention_heads {heads}"
    if kv_channels <= 0 or kv_channels % 2:
        return f"{p}model.kv_channels: {kv_channels} must be a positive even integer (RoPE rotates pairs of channels)"
    return None


# The ModelConfig keys beyond the common shape that only some architectures compute: each family's
# ARCHITECTURE.switches (runtime/families/<name>), in the registry's order; model.moe aside (rules_moe.py judges it
# by the registry's `moe`).
MODEL_SWITCHES = tuple(dict.fromkeys(key for network in ARCHITECTURES.values() for key in network.switches
                                     if key != "moe"))
LAYER_TYPES = ("sliding_attention", "full_attention")


def llama_switches(architecture: str | None, switches: dict, p: str) -> list[str]:
    """Keys only some architectures compute (the registry's `switches`): the Llama decoder's add_qkv_bias,
    qk_layernorm and rope_scaling (GPT has learned positions and biases everywhere), and those a folder family
    declares. An unknown or absent architecture is not judged here (its own key names it)."""
    network = known_architecture(architecture)
    if network is None:
        return []
    problems = []
    for key, value in switches.items():
        if value is None or value is False or key in network.switches:
            continue
        which = [a.name for a in ARCHITECTURES.values() if key in a.switches]
        problems.append(f"{p}model.{key}: architecture={architecture} does not compute it; drop {p}model.{key} "
                        f"(architectures that do: {', '.join(which)})")
    return problems


def attention_layers(layer_types, window: int | None, num_layers: int, p: str) -> str | None:
    """model.layer_types: one of LAYER_TYPES per layer; sliding layers need model.sliding_window."""
    if layer_types is None:
        return None if window is None or window > 0 else f"{p}model.sliding_window: {window} must be positive"
    bad = [t for t in layer_types if t not in LAYER_TYPES]
    if bad or len(layer_types) != num_layers:
        return (f"{p}model.layer_types: {list(layer_types)} must list num_layers ({num_layers}) of "
                f"{' / '.join(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and (window is None or window <= 0):
        return f"{p}model.sliding_window: {window} must be a positive integer where layer_types has sliding layers"
    return None


def context_window(layer_types, cp: int, ulysses: int, p: str) -> str | None:
    """Context parallelism's attentions (ring, Ulysses) see whole sequences: sliding-window layers are not built."""
    if max(cp, ulysses) > 1 and layer_types is not None and "sliding_attention" in layer_types:
        key = "context_parallel_size" if cp > 1 else "ulysses_parallel_size"
        return (f"{p}model.{key}: {max(cp, ulysses)} with sliding-window layers (model.layer_types): context "
                f"parallelism here has no sliding window; set {key}=1")
    return None


def rope_scaling(scaling, key: str) -> list[str]:
    """model.rope_scaling (a RopeScaling): a positive factor; for llama3, 0 < low_freq_factor < high_freq_factor
    (transformers refuses the same) and the original context."""
    problems = []
    if not scaling.factor > 0:
        problems.append(f"{key}.factor: {scaling.factor} must be positive")
    if scaling.rope_type == "yarn":
        if scaling.original_max_position_embeddings <= 0:
            problems.append(f"{key}.original_max_position_embeddings: "
                            f"{scaling.original_max_position_embeddings} must be a positive integer")
        if not scaling.beta_fast >= scaling.beta_slow > 0:
            problems.append(f"{key}: beta_slow ({scaling.beta_slow}) must be positive and at most beta_fast "
                            f"({scaling.beta_fast})")
    if scaling.rope_type == "llama3":
        if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
            problems.append(f"{key}: low_freq_factor ({scaling.low_freq_factor}) must be positive and below "
                            f"high_freq_factor ({scaling.high_freq_factor})")
        if scaling.original_max_position_embeddings <= 0:
            problems.append(f"{key}.original_max_position_embeddings: "
                            f"{scaling.original_max_position_embeddings} must be a positive integer")
    return problems


def heads_groups(heads: int, groups: int, p: str) -> str | None:
    if heads % groups == 0:
        return None
    return f"{p}model.num_query_groups: {groups} does not divide num_attention_heads {heads}"


def heads_tp(heads: int, tp: int, p: str) -> str | None:
    if heads % tp == 0:
        return None
    return f"{p}model.num_attention_heads: {heads} is not divisible by tensor_model_parallel_size {tp}"


def ffn_tp(ffn: int, tp: int, p: str, key: str = "ffn_hidden_size") -> str | None:
    """An MLP's (or each expert's: key moe.ffn_hidden_size) hidden units are split over the TP ranks."""
    if ffn % tp == 0:
        return None
    return f"{p}model.{key}: {ffn} is not divisible by tensor_model_parallel_size {tp}"


def kv_heads_tp(groups: int, tp: int, p: str) -> str | None:
    """KV heads are split when tp divides them and replicated when they divide tp (runtime/parallel/layers.py)."""
    if groups % tp == 0 or tp % groups == 0:
        return None
    return (f"{p}model.num_query_groups: {groups} KV heads can be neither split over nor replicated to "
            f"tensor_model_parallel_size {tp}; one must divide the other")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of make_vocab_size_divisible_by.

    Padding depends only on these two numbers, never on the tensor-parallel size, so the embedding shape (and
    therefore the initialization and the checkpoint) is the same under every layout; vocab_tp checks tp divides it.
    """
    return math.ceil(vocab_size / divisible_by) * divisible_by


def vocab_tp(vocab_size: int | None, divisible_by: int, tp: int, p: str) -> str | None:
    """The padded vocabulary is split over the TP ranks. Without the tokenizer (built later by this launch's
    data_preparation, or not on this machine) only a multiple of tp is certain to work: the parsers report that
    case as a warning, and the node, which has the tokenizer, decides."""
    if vocab_size is None:
        if divisible_by % tp == 0:
            return None
        return (f"{p}model.make_vocab_size_divisible_by: {divisible_by} is not a multiple of "
                f"tensor_model_parallel_size {tp}; whether the padded vocabulary divides by {tp} is checked once "
                f"the tokenizer exists (a multiple of {tp} always does)")
    padded = padded_vocab_size(vocab_size, divisible_by)
    if padded % tp == 0:
        return None
    return (f"{p}model.make_vocab_size_divisible_by: the padded vocabulary {padded} ({vocab_size} tokens rounded up "
            f"to a multiple of {divisible_by}) is not divisible by tensor_model_parallel_size {tp}; use a "
            f"multiple of {tp}")


def unpadded_vocab(unpadded: int | None, padded: int) -> str | None:
    """A source's vocabulary (config.json's vocab_size) is padded up, never cut: its rows are all loaded."""
    if unpadded is None or 0 < unpadded <= padded:
        return None
    return (f"model.unpadded_vocab_size: {unpadded} must be a positive integer no larger than the padded vocab_size "
            f"{padded}")


def positions(max_positions: int, seq_length: int, p: str) -> str | None:
    if max_positions >= seq_length:
        return None
    return (f"{p}model.max_position_embeddings: {max_positions} is smaller than encoder_seq_length {seq_length}; "
            f"raise it to at least {seq_length}")


def data_seq_length(data_seq: int, seq_length: int, p: str) -> str | None:
    if data_seq == seq_length:
        return None
    return f"{p}model.data.seq_length: {data_seq} differs from model.encoder_seq_length {seq_length}; make them equal"


DROPOUTS = ("hidden_dropout", "attention_dropout", "ffn_dropout")  # model keys, each a probability in [0, 1)


def dropout(name: str, value: float, p: str) -> str | None:
    if 0.0 <= value < 1.0:
        return None
    return f"{p}model.{name}: {value} must be in [0, 1)"


MAX_VOCAB = 2**31  # rows an embedding may have: token ids are int32 in the data's index files and in NxD's kernels


def vocab_rows(vocab: int, key: str, source: str) -> str | None:
    """A vocabulary no embedding holds (an id of 99,999,999,998 in a tokenizer.json: 4.5 TB of embedding), refused
    before any memory is sized for it. `source` names the file it was read from."""
    if vocab <= MAX_VOCAB:
        return None
    return (f"{key}: {source} has {vocab:,} tokens, more than an embedding holds (at most "
            f"{MAX_VOCAB:,}); give the model's own tokenizer")


# A Hugging Face model's tensors with a row per token (transformers' names, every family's ends so).
VOCAB_TENSORS = ("embed_tokens.weight", "wte.weight", "lm_head.weight")


def weights_vocab(shapes: dict[str, tuple[int, ...]], vocab: int, key: str, config: str) -> str | None:
    """A starting point's embedding and head hold `vocab` rows (its config.json's vocab_size, which the model pads
    from): weights of another vocabulary cannot load, found here from the safetensors headers."""
    for name, shape in sorted(shapes.items()):
        if name.endswith(VOCAB_TENSORS) and len(shape) == 2 and shape[0] != vocab:
            return (f"{key}: its {name} has {shape[0]} rows but {config} has vocab_size {vocab}; the weights are "
                    f"another model's: use the config.json saved with them")
    return None


def tokenizer_fits(tokenizer_vocab: int, config_vocab: int, p: str) -> str | None:
    if tokenizer_vocab <= config_vocab:
        return None
    return (f"{p}model.tokenizer.model: the tokenizer has {tokenizer_vocab} tokens but the model's config.json has "
            f"vocab_size {config_vocab}; use the model's own tokenizer")
