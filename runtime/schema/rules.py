# Every pure rule on a stage config, written once. The launcher runs them at launch and at --dry-run, the
# runtime's loaders run them again on the node, and ParallelDims / ModelConfig / LRSchedule call them for
# configs built in code: each rule has one definition and one message.
#
# A rule takes typed values and returns None, or one line that starts with the key to change and says the fix.
# `p` is the stage's key prefix ("training." for the training stage), so messages name the override to type.
from __future__ import annotations

import math
import os
import re

from runtime.schema.families import ARCHITECTURES, known_architecture

# Slurm's own time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_SLURM_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$", re.IGNORECASE)
# Paths and names that end up in #SBATCH lines and job names: sbatch reads those lines itself, unquoted.
_PATH_UNSAFE = re.compile(r"[\s'\"\\]")


def slurm_seconds(value: str) -> int | None:
    """Slurm's time formats in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None for UNLIMITED, INFINITE or
    anything that is not a Slurm time."""
    value = str(value).strip()
    if value.upper() in ("UNLIMITED", "INFINITE") or not _SLURM_TIME.match(value):
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


# ---------------------------------------------------------------------------------------------------------- run
def time_limit(value: object, p: str) -> str | None:
    if _SLURM_TIME.match(str(value)):
        return None
    return f"{p}run.time_limit: {value!r} is not a Slurm time; use H:MM:SS or D-HH:MM:SS, e.g. 4:00:00"


def results_dir(value: object, p: str) -> str | None:
    text = "" if value is None else str(value)
    if text.startswith("/") and not _PATH_UNSAFE.search(text) and text.isprintable():
        return None
    return (f"{p}run.results_dir: {text!r} must be an absolute path without spaces, quotes or backslashes "
            f"(it appears in #SBATCH lines)")


NAME_MAX = 255    # bytes in one path component (Linux's, and every file system's it mounts)
PATH_MAX = 4096   # bytes in a whole path


def path_length(value: object, key: str) -> str | None:
    """A path no file system can hold: checked before any call on it (the OS answers `File name too long`)."""
    text = "" if value is None else str(value)
    if len(text.encode(errors="surrogateescape")) >= PATH_MAX:
        return (f"{key}: a path of {len(text.encode(errors='surrogateescape')):,} bytes is longer than any file "
                f"system takes (at most {PATH_MAX - 1}); give a shorter path")
    long = [part for part in text.split("/") if len(part.encode(errors="surrogateescape")) > NAME_MAX]
    if long:
        return (f"{key}: the path's part {long[0][:40]!r}... is {len(long[0].encode(errors='surrogateescape')):,} "
                f"bytes, more than a file system takes in one name (at most {NAME_MAX}); give a shorter name")
    return None


SEED_MAX = 2**32 - 1  # numpy's generators take seeds in [0, 2**32 - 1]; torch.manual_seed takes these too


def seed(value: int, key: str) -> str | None:
    if 0 <= value <= SEED_MAX:
        return None
    return f"{key}: {value} must be in [0, {SEED_MAX}] (numpy and torch seed their generators with it), e.g. 1234"


def unsafe_path(value: str) -> bool:
    """True for a path or name that cannot stand unquoted in an #SBATCH line."""
    return bool(_PATH_UNSAFE.search(value)) or not value.isprintable()


def preemption_signal(signal_s: int, limit: str, p: str) -> str | None:
    if not 0 <= signal_s <= 65535:
        return (f"{p}run.preemption_signal_s: {signal_s!r} must be whole seconds from 0 to 65535 "
                "(how long before run.time_limit Slurm signals the job; 0 or null: no signal)")
    limit_s = slurm_seconds(limit)
    if signal_s and limit_s is not None and signal_s >= limit_s:
        return (f"{p}run.preemption_signal_s: {signal_s} s is not shorter than run.time_limit {limit} ({limit_s} s): "
                "every run would be signalled as it starts; use fewer seconds")
    return None


# ------------------------------------------------------------------------------------------------------ layout
def world_divisible(world: int, world_text: str, tp: int, pp: int, p: str) -> str | None:
    """The world must split into whole tp x pp model replicas; what is left is data parallelism."""
    if world % (tp * pp) == 0:
        return None
    return (f"{p}trainer: {world_text} is not divisible by tensor_model_parallel_size × "
            f"pipeline_model_parallel_size = {tp} × {pp} = {tp * pp}; change the node count or the parallel sizes")


def world_text(num_nodes: int, devices: int) -> str:
    return f"num_nodes × devices = {num_nodes} × {devices} = {num_nodes * devices}"


def tp_within_node(tp: int, devices: int, p: str) -> str | None:
    """Tensor-parallel groups are consecutive ranks (runtime/parallel/dims.py) and talk inside every layer: a
    group must not cross a node."""
    if devices % tp == 0:
        return None
    return (f"{p}model.tensor_model_parallel_size: {tp} must divide trainer.devices {devices} so every "
            f"tensor-parallel group stays inside one node; use a divisor of {devices}")


def global_batch(gbs: int, mbs: int, dp: int, p: str) -> str | None:
    if gbs % (mbs * dp) == 0:
        return None
    return (f"{p}model.global_batch_size: {gbs} is not divisible by micro_batch_size × data-parallel size = "
            f"{mbs} × {dp} = {mbs * dp}; use a multiple of {mbs * dp}")


def interleaved_micro_batches(micro_batches: int, pp: int, p: str) -> str | None:
    if micro_batches % pp == 0:
        return None
    return (f"{p}model.virtual_pipeline_model_parallel_size: the interleaved schedule needs the micro-batch count "
            f"({micro_batches}) to be a multiple of pipeline_model_parallel_size ({pp}); raise global_batch_size "
            f"or set virtual_pipeline_model_parallel_size=null")


def virtual_needs_pipeline(vpp: int | None, pp: int, p: str) -> str | None:
    if vpp is None or vpp == 1 or pp > 1:
        return None
    return (f"{p}model.virtual_pipeline_model_parallel_size: {vpp} needs pipeline_model_parallel_size > 1; "
            f"set it to null")


def layers_split(layers: int, pp: int, vpp: int | None, p: str, cuts: tuple[int, ...] | None = None) -> str | None:
    """Layers over pipeline_model_parallel_size x virtual stages: where model.pipeline_cuts says (NxD Training's
    key: the last layer of every stage but the last, so uneven stages balance the embedding and the head), else as
    evenly as they go (NxD Training's default too: Llama 3.1 405B's 126 layers over pp 32), each stage at least one."""
    chunks = pp * (vpp or 1)
    if cuts is not None:
        bounds = [-1, *cuts, layers - 1]
        if len(cuts) == chunks - 1 and all(b > a for a, b in zip(bounds, bounds[1:])):
            return None
        return (f"{p}model.pipeline_cuts: {list(cuts)} must be {chunks - 1} increasing layer indices below "
                f"{layers - 1} (the last layer of each of the {chunks} stages but the last: pipeline_model_parallel_"
                f"size x virtual_pipeline_model_parallel_size = {pp} x {vpp or 1}), e.g. "
                f"{[round(layers * (i + 1) / chunks) - 1 for i in range(chunks - 1)]}")
    if layers >= chunks:
        return None
    return (f"{p}model.num_layers: {layers} is fewer than the pipeline stages, pipeline_model_parallel_size × "
            f"virtual_pipeline_model_parallel_size = {pp} × {vpp or 1} = {chunks}; every stage needs a layer")


def stage_layers(layers: int, stages: int, cuts: tuple[int, ...] | None = None) -> list[range]:
    """Layer index ranges of `stages` global pipeline stages, in stage order (the one owner of the split: the
    runtime builds its stages by it, the estimator counts them by it). cuts: model.pipeline_cuts, checked by
    layers_split; without them the extra layers of an uneven split go to the earliest stages (the last stage
    already carries the output head and the loss)."""
    if cuts is not None:
        bounds = [-1, *cuts, layers - 1]
        return [range(a + 1, b + 1) for a, b in zip(bounds, bounds[1:])]
    base, extra = divmod(layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


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


# The model keys only the Llama decoder computes.
LLAMA_SWITCHES = ("add_qkv_bias", "qk_layernorm", "rope_scaling")
# The model keys only the folder families that declare them compute (runtime/families, ARCHITECTURE.switches).
FAMILY_SWITCHES = ("sliding_window", "layer_types", "local_rotary_base", "softmax_scale", "latent_attention")
MODEL_SWITCHES = LLAMA_SWITCHES + FAMILY_SWITCHES
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


# ------------------------------------------------------------------------------------------- optimizer, schedule
def betas(value: object, p: str) -> str | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value):
        return None
    return f"{p}model.optim.betas: {value!r} is invalid; expected [beta1, beta2] each in [0, 1)"


def learning_rate(lr: float, p: str) -> str | None:
    if lr > 0:
        return None
    return f"{p}model.optim.lr: {lr!r} must be > 0"


def optimizer_options(name: str, momentum: float, dampening: float, nesterov: bool, p: str) -> str | None:
    """What torch.optim.SGD and schedulefree refuse, said at launch."""
    if name in ("sgd", "sgd_schedulefree") and momentum >= 1:
        return f"{p}model.optim.momentum: {momentum!r} must be below 1"
    if name == "sgd" and nesterov and (momentum <= 0 or dampening != 0):
        return (f"{p}model.optim.nesterov: Nesterov momentum needs model.optim.momentum > 0 and "
                f"model.optim.dampening 0 (momentum {momentum}, dampening {dampening})")
    return None


def optimizer_layout(name: str, zero1: bool, tp: int, ep: int, p: str) -> str | None:
    """Adafactor factors each weight's second moment into row and column statistics of the whole 2-D parameter
    (and scales its step by the parameter's RMS): a flat ZeRO-1 shard, or a tensor- or expert-parallel slice,
    would compute other statistics than one process does, so it runs on whole parameters only."""
    if name != "adafactor":
        return None
    split = [key for key, on in (("model.zero1", zero1), ("model.tensor_model_parallel_size", tp > 1),
                                 ("model.expert_model_parallel_size", ep > 1)) if on]
    if not split:
        return None
    return (f"{p}model.optim.name: adafactor factors whole 2-D parameters, so it cannot run with "
            f"{' or '.join(split)}; turn {'them' if len(split) > 1 else 'it'} off or choose adamw, adam, sgd or "
            f"a schedule-free optimizer")


def min_lr(minimum: float, lr: float, schedule: str, p: str) -> str | None:
    if schedule == "Constant" or 0 <= minimum <= lr:
        return None
    return f"{p}model.optim.sched.min_lr: {minimum!r} must be between 0 and model.optim.lr {lr}"


def schedule_fits(warmup: int, constant: int, max_steps: int, p: str) -> str | None:
    """A warmup longer than the training never reaches the learning rate: refused."""
    if warmup <= max_steps:
        return None
    return (f"{p}model.optim.sched.warmup_steps: warmup_steps {warmup} exceeds trainer.max_steps {max_steps}; "
            f"shorten the warmup or train longer")


def schedule_holds(warmup: int, constant: int, max_steps: int, p: str) -> str | None:
    """constant_steps reaching past max_steps leaves no room to decay: NeMo's schedules then hold min_lr from the end
    of the warmup (their decay length, max_steps - warmup - constant, is negative), as runtime/optim_schedule.py does
    (NxD's megatron_gpt_config: 750 + 80000 over 20000 steps). Legal, and surely not what most users mean: a
    warning."""
    if warmup + constant <= max_steps or warmup > max_steps:
        return None
    return (f"{p}model.optim.sched.constant_steps: warmup_steps {warmup} + constant_steps {constant} exceeds "
            f"trainer.max_steps {max_steps}: as in NeMo, the learning rate holds min_lr from step {warmup + 1} to the "
            f"end, with no decay; lower constant_steps to {max_steps - warmup} or less to decay")


# ------------------------------------------------------------------------------------------ trainer, checkpoints
def val_check_whole(value: object, p: str) -> str | None:
    if not isinstance(value, float) or (math.isfinite(value) and value == int(value)):
        return None
    return (f"{p}trainer.val_check_interval: {value!r} must be a whole number of steps (fractions of an epoch are "
            f"not supported: training is step based)")


def splits(value: object, p: str) -> str | None:
    """train,valid,test weights as Megatron reads them: up to three non-negative numbers with a positive sum."""
    try:
        parts = [float(x) for x in str(value).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if parts and len(parts) <= 3 and all(math.isfinite(x) and x >= 0 for x in parts) and sum(parts) > 0:
        return None
    return (f"{p}model.data.splits_string: {value!r} is invalid; expected up to three non-negative weights for "
            f"train,valid,test such as '98,1,1'")


def save_top_k(value: int, p: str) -> str | None:
    if value == -1 or value > 0:
        return None
    return (f"{p}exp_manager.checkpoint_callback_params.save_top_k: {value} is invalid; use a positive count of "
            f"checkpoints to keep, or -1 to keep all")


# ---------------------------------------------------------------------------------------------------- cluster.s3
def endpoint_url(value: str, p: str) -> str | None:
    """boto3 takes a scheme and a host; a bare host name would fail on the node, at the first transfer."""
    if re.fullmatch(r"https?://[^\s/'\"\\][^\s'\"\\]*", value) and value.isprintable():
        return None
    return (f"{p}endpoint_url: {value!r} is not an http:// or https:// URL; give the S3 endpoint with its scheme, "
            f"e.g. {p}endpoint_url=https://s3.us-west-2.amazonaws.com (null: AWS S3 itself)")


# ------------------------------------------------------------------------------------------------ names, paths
# A run name is one directory name (NAME_MAX: 255 bytes on ext4, xfs and Lustre/FSx), and names are built from it:
# autoconfig's trial runs are `<name>_NN_<layout tag>` directories (a tag is under 45 bytes), Slurm job names are
# `<job_name_prefix><run_name>:<stage>`. 200 bytes leaves 55 for those suffixes.
RUN_NAME_MAX_BYTES = 200


def run_name(value: object, key: str) -> str | None:
    """`key` is the full key the user sets (run_name, training.run.name, cluster_validation.run.name)."""
    if value is not None and not isinstance(value, str):  # run_name=1e3 arrives as 1000.0: say so, don't guess
        return f"{key}: {value!r} is not text; quote a name made of digits, e.g. {key}='{value}'"
    name = value or ""
    if name in ("", ".", ".."):
        return (f"{key}: {name!r} names no directory of its own (it would put the stages into base_results_dir "
                f"or its parent); use a plain name, e.g. {key}=my_run")
    if "/" in name or unsafe_path(name):
        return (f"{key}: {name!r} must be non-empty, without '/', spaces, quotes or backslashes "
                f"(it names a directory and Slurm jobs); e.g. {key}=my_run")
    if "%" in name:
        return slurm_pattern(name, key)
    size = len(name.encode())
    if size > RUN_NAME_MAX_BYTES:
        return (f"{key}: the name is {size} bytes; use at most {RUN_NAME_MAX_BYTES} (it names a directory, at most "
                f"255 bytes, and autoconfig and Slurm job names add to it)")
    return None


def slurm_pattern(value: str, key: str) -> str | None:
    """sbatch expands %j, %A, %x and the like in `#SBATCH --output`, the job script's $LOG_DIR does not: a '%' in a
    path or name there would send Slurm's log and the script's own files to different directories."""
    if "%" not in value:
        return None
    return (f"{key}: {value!r} contains '%', which sbatch expands in #SBATCH --output (%j is the job id) while the "
            f"job script does not; leave the '%' out")


# ----------------------------------------------------------------------------------------------- data_preparation
MAX_RECORD_MB = 2147     # 2^31 - 1 bytes, less room for the eod token: the .idx stores a document's length as int32


def max_record_mb(value: float, p: str) -> str | None:
    """A record is held whole while it is parsed and tokenized (about 110 bytes of memory per byte of text with a
    byte-level BPE), and a tokenizer gives at most one token per byte, so this bound keeps every document's
    token count within the .idx's int32 lengths."""
    if 0 < value <= MAX_RECORD_MB:
        return None
    return (f"{p}input.max_record_mb: {value!r} must be > 0 and at most {MAX_RECORD_MB} (a document's token count "
            f"is an int32 in the .idx); longer records are skipped and counted, or fail the task with "
            f"input.on_long_record: fail")



def moe(architecture: str, num_experts: int, top_k: int, frequency: int, num_layers: int,
        capacity_factor: float | None, activation: str, p: str, *, layers: tuple[int, ...] | None = None,
        ffn: int | None = None, ffn_dropout: float | None = None, groups: tuple[int, int] = (1, 1)) -> list[str]:
    """model.moe: a sparse MoE block needs the Llama block (SwiGLU experts), top_k of the experts, a layer pattern
    that leaves at least one MoE layer, and a positive capacity factor (or dropless); model.ffn_dropout is the dense
    MLP's, which the experts do not have. `groups`: (moe.groups, moe.top_groups), group-limited routing's groups of
    at least 2 experts (each ranked by its two best), top_groups of them holding at least top_k experts."""
    key = f"{p}model.moe"
    problems = []
    network = known_architecture(architecture)
    if network is not None and not network.moe:
        problems.append(f"{key}: MoE layers are Mixtral's (SwiGLU experts in the Llama block); set "
                        f"{p}model.architecture={' or '.join(a.name for a in ARCHITECTURES.values() if a.moe)}")
    if num_experts < 2:
        problems.append(f"{key}.num_experts: {num_experts} must be at least 2 (1 expert is the dense MLP)")
    elif not 1 <= top_k <= num_experts:
        problems.append(f"{key}.top_k: {top_k} must be from 1 to num_experts ({num_experts})")
    if layers is not None:
        if not layers or any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
            problems.append(f"{key}.layers: {list(layers)} must list distinct layer indexes from 0 to "
                            f"{num_layers - 1}, at least one; or drop it to use {key}.frequency")
    elif not 1 <= frequency <= num_layers:
        problems.append(f"{key}.frequency: {frequency} must be from 1 (every layer) to num_layers ({num_layers})")
    if ffn is not None and ffn <= 0:
        problems.append(f"{key}.ffn_hidden_size: {ffn} must be a positive integer; or null for model.ffn_hidden_size")
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        problems.append(f"{key}.capacity_factor: {capacity_factor} must be a positive number; or set "
                        f"{key}.dropless=true")
    if activation not in ("softmax", "sigmoid"):
        problems.append(f"{key}.router_activation: {activation!r} is not one of softmax, sigmoid")
    count, top = groups
    if count > 1 and (num_experts % count or num_experts // count < 2):
        problems.append(f"{key}.groups: {count} must divide num_experts ({num_experts}) into groups of at least 2 "
                        "experts (a group is ranked by its two best scores)")
    elif not 1 <= top <= count:
        problems.append(f"{key}.top_groups: {top} must be from 1 to groups ({count})")
    elif top_k > top * (num_experts // count):
        problems.append(f"{key}.top_k: {top_k} is more than the {top * (num_experts // count)} experts of "
                        f"top_groups ({top}) groups; raise top_groups")
    if ffn_dropout:
        problems.append(f"{p}model.ffn_dropout: {ffn_dropout} with {key}: dropout inside the experts is not built; "
                        f"set it to 0.0")
    return problems


def bias_update(rate: float, score_bias: bool, p: str, *, lora: bool = False) -> str | None:
    """model.moe.router_bias_update_rate moves the expert selection bias (DeepSeek-V3's aux-loss-free balancing):
    it needs one (model.moe.score_bias), and one that trains (LoRA keeps the base model, the bias with it, frozen)."""
    key = f"{p}model.moe.router_bias_update_rate"
    if not math.isfinite(rate) or rate < 0:
        return f"{key}: {rate} must be a number >= 0 (0.0 keeps the selection bias as loaded)"
    if rate and not score_bias:
        return (f"{key}: {rate} updates the expert selection bias, which needs {p}model.moe.score_bias=true "
                f"(DeepSeek-V3's router); set score_bias=true or router_bias_update_rate=0.0")
    if rate and lora:
        return (f"{key}: {rate} with LoRA: the base model, its selection bias with it, stays frozen; set "
                f"router_bias_update_rate=0.0 (or fine-tune fully)")
    return None


def expert_layout(num_experts: int | None, ep: int, dp: int, p: str) -> str | None:
    """model.expert_model_parallel_size shards the experts over part of data parallelism (Megatron's and NxD
    Training's layout): it must divide both the data-parallel size and the number of experts."""
    if ep == 1:
        return None
    if num_experts is None:
        return f"{p}model.expert_model_parallel_size: {ep} needs MoE layers (set {p}model.moe.num_experts) or 1"
    return ep_divides_dp(ep, dp, p) or ep_divides_experts(ep, num_experts, p)


def ep_divides_dp(ep: int, dp: int, p: str) -> str | None:
    if ep >= 1 and dp % ep == 0:
        return None
    return (f"{p}model.expert_model_parallel_size: {ep} must divide the data-parallel size {dp} (world / "
            f"(tensor_model_parallel_size x pipeline_model_parallel_size)); use a divisor of {dp}")


def ep_divides_experts(ep: int, num_experts: int, p: str) -> str | None:
    if num_experts % ep == 0:
        return None
    return (f"{p}model.expert_model_parallel_size: {ep} must divide {p}model.moe.num_experts ({num_experts}); "
            f"use a divisor of {num_experts}")


def dropless_on_xla(capacity_factor: float | None, accelerator: str, p: str) -> str | None:
    """Dropless expert batches are as wide as the busiest expert's count, a shape that follows the routing: XLA
    compiles a graph for each new one (minutes each with the Neuron compiler). A capacity fixes every shape."""
    if capacity_factor is None and accelerator == "neuron":
        return (f"{p}model.moe.dropless: expert batch shapes follow the routing, and the Neuron compiler compiles "
                f"each new one; set {p}model.moe.dropless=false with a capacity_factor (NxD Training's Trn1 recipe: "
                f"2.0) for fixed shapes")
    return None


# ----------------------------------------------------------------------------------------------- long context
CONTEXT_KEYS = {"ring": "context_parallel_size", "ulysses": "ulysses_parallel_size"}


def context_kind(cp: int, ulysses: int) -> str | None:
    """Which way the sequence is split over the context group: 'ring' (context parallelism), 'ulysses', or None."""
    return "ring" if cp > 1 else "ulysses" if ulysses > 1 else None


def context_layout(cp: int, ulysses: int, dp: int, p: str) -> str | None:
    """The context group (the ranks that split one sequence) is carved out of data parallelism, as Megatron's
    context parallelism is: its size must divide the data-parallel size. One kind of split at a time."""
    if cp > 1 and ulysses > 1:
        return (f"{p}model.ulysses_parallel_size: {ulysses} together with context_parallel_size {cp}; split the "
                f"sequence one way: set one of them to 1")
    size, key = max(cp, ulysses), CONTEXT_KEYS[context_kind(cp, ulysses) or "ring"]
    if size >= 1 and dp % size == 0:
        return None
    return (f"{p}model.{key}: {size} must divide the data-parallel size {dp} (world / (tensor_model_parallel_size "
            f"x pipeline_model_parallel_size)), out of which the context group is carved; use a divisor of {dp}")


def context_sequence(seq: int, cp: int, ulysses: int, tp: int, sequence_parallel: bool, p: str) -> str | None:
    """Ring attention balances causal work by giving rank r the sequence chunks r and 2·cp−1−r, so the sequence
    splits into 2·cp equal chunks; Ulysses splits it into `ulysses` contiguous ones. Sequence parallelism then
    splits each rank's tokens over tensor parallelism."""
    kind = context_kind(cp, ulysses)
    if kind is None:
        return None
    parts = 2 * cp if kind == "ring" else ulysses
    key, size = CONTEXT_KEYS[kind], max(cp, ulysses)
    if seq % parts:
        why = f"2 × {key} = {parts} (each rank holds two chunks, for causal load balance)" if kind == "ring" else \
            f"{key} = {parts}"
        return f"{p}model.encoder_seq_length: {seq} is not divisible by {why}; use a multiple of {parts}"
    if sequence_parallel and tp > 1 and (seq // size) % tp:
        return (f"{p}model.encoder_seq_length: {seq} / {key} {size} = {seq // size} tokens per rank do not split "
                f"over tensor_model_parallel_size {tp} for sequence parallelism; use a multiple of {size * tp}")
    return None


def ulysses_heads(heads: int, tp: int, ulysses: int, p: str) -> str | None:
    """Ulysses trades the sequence split for a head split around attention: each rank's heads (after tensor
    parallelism) must divide evenly. KV heads that do not divide are replicated, so only the query heads count."""
    if ulysses <= 1 or heads % tp or (heads // tp) % ulysses == 0:
        return None
    return (f"{p}model.ulysses_parallel_size: {ulysses} must divide the attention heads per tensor-parallel rank "
            f"(num_attention_heads {heads} / tensor_model_parallel_size {tp} = {heads // tp}); use a divisor of "
            f"{heads // tp}, or context_parallel_size")


def context_architecture(num_experts: int | None, attention_dropout: float, cp: int, ulysses: int,
                         p: str) -> str | None:
    """What cannot split its sequence exactly. MoE: routing capacity and the load-balancing loss are functions of
    the whole micro-batch's tokens, so a rank routing only its share would drop and balance differently. Ring
    attention: it merges partial softmaxes, with no place for attention dropout's mask."""
    kind = context_kind(cp, ulysses)
    if kind is None:
        return None
    key, size = CONTEXT_KEYS[kind], max(cp, ulysses)
    if num_experts:
        return (f"{p}model.{key}: {size} with MoE layers (model.moe.num_experts {num_experts}): routing and its "
                f"losses need each micro-batch's whole sequence; set {key}=1 and use expert_model_parallel_size")
    if kind == "ring" and attention_dropout:
        return (f"{p}model.attention_dropout: {attention_dropout} with context_parallel_size {cp}: ring attention "
                f"has no attention dropout; set attention_dropout=0.0 (or use ulysses_parallel_size)")
    return None


# ------------------------------------------------------------------------------------------------ fine-tuning
def lora_rank(rank: int, p: str) -> str | None:
    if rank <= 0:
        return f"{p}model.peft.lora_rank: {rank} must be a positive integer (8, 16 and 32 are usual)"
    return None


def lora_alpha(alpha: float, p: str) -> str | None:
    if alpha <= 0:
        return f"{p}model.peft.lora_alpha: {alpha} must be > 0 (the adapters' scale is lora_alpha / lora_rank)"
    return None


def lora_dropout(value: float, p: str) -> str | None:
    if not 0.0 <= value < 1.0:
        return f"{p}model.peft.lora_dropout: {value} must be in [0, 1)"
    return None


_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def lora_modules(architecture: str | None, latent=None) -> tuple[str, ...]:
    """The projections LoRA can adapt on a model, by Hugging Face name (groups aside). Multi-head latent attention
    (`latent`: model.latent_attention) has its own, its queries' by q_lora_rank; where it is not known whether the
    model has it (no architecture, or one that may have it, without its latent_attention): both kinds' names."""
    from runtime.schema.choices import LATENT_LORA_MODULES, LATENT_LORA_PARTS, LORA_MODULES

    network = known_architecture(architecture)  # an unknown one: a gate assumed, its own key names it
    mlp = _MLP_MODULES if network is None or network.gated_mlp else _MLP_MODULES[1:]
    if latent is not None:
        queries = ("q_proj",) if latent.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        return tuple(m for m in LATENT_LORA_MODULES if m in queries or m not in LATENT_LORA_PARTS["q_proj"]) + mlp
    attention = tuple(m for m in LORA_MODULES if m not in _MLP_MODULES)
    if network is None or "latent_attention" in network.switches:
        attention = tuple(dict.fromkeys(attention + LATENT_LORA_MODULES))
    return attention + mlp


def lora_targets(names: tuple[str, ...], architecture: str | None, p: str, latent=None) -> str | None:
    """The projections LoRA adapts, by Hugging Face name, or a group of them; GPT's MLP has no gate (its fc1 is
    up_proj); multi-head latent attention has no k_proj / v_proj, and q_proj only without q_lora_rank."""
    from runtime.schema.choices import LORA_GROUPS
    from runtime.schema.reader import closest

    key = f"{p}model.peft.target_modules"
    modules = lora_modules(architecture, latent)
    if not names:
        return f"{key}: empty; name the projections to adapt, e.g. [qkv_proj] (valid: {', '.join(modules)})"
    valid = modules + tuple(LORA_GROUPS)
    for name in names:
        if name == "gate_proj" and name not in modules:
            return f"{key}: gate_proj: GPT's MLP has no gate projection; adapt up_proj / down_proj (fc1 / fc2)"
        if name in valid:
            continue
        if latent is None:
            return (f"{key}: {name!r} is not a projection LoRA can adapt; {closest(name, valid)}valid: "
                    f"{', '.join(valid)}")
        queries = "one q_proj (q_lora_rank null)" if latent.q_lora_rank is None else \
            f"q_a_proj and q_b_proj (q_lora_rank {latent.q_lora_rank})"
        return (f"{key}: {name!r} is not a projection of this multi-head latent attention (model.latent_attention: "
                f"no k_proj / v_proj; queries through {queries}); {closest(name, valid)}valid: {', '.join(valid)}")
    return None


def lora_moe(num_experts: int | None, targets: tuple[str, ...], p: str, latent=None) -> str | None:
    mlp = [t for t in targets if t in _MLP_MODULES]
    if num_experts and mlp:
        attention = [m for m in lora_modules(None, latent) if m not in _MLP_MODULES] if latent is not None else \
            ["q_proj", "k_proj", "v_proj", "o_proj"]
        return (f"{p}model.peft.target_modules: {', '.join(mlp)} on a mixture-of-experts model: adapters on experts "
                f"are not built; adapt the attention projections only ({', '.join(attention)}: qkv_proj and "
                f"attention_dense name them)")
    return None


def document_reset(positions: bool | None, attention: bool | None, p: str) -> str | None:
    """Megatron's reset_position_ids and reset_attention_mask: documents separated inside a pretraining sequence
    (positions restart after each end-of-document token and attention stops there), built as one switch."""
    if positions is None or attention is None or positions == attention:
        return None
    return (f"{p}model.data.reset_position_ids: {positions} with reset_attention_mask: {attention}: documents are "
            f"separated in positions and attention together here; set both to {positions or attention} (or both "
            f"to false)")


def document_reset_eod(eod: int | None, tokenizer: str, p: str) -> str | None:
    if eod is not None:
        return None
    return (f"{p}model.data.reset_attention_mask: true, but the tokenizer {tokenizer} has no end-of-document token "
            f"to separate documents at; name its eos_token in the tokenizer_config.json beside it, or set "
            f"reset_position_ids and reset_attention_mask to false")


def packing_context(packing: bool, context: int, p: str) -> str | None:
    if packing and context > 1:
        return (f"{p}model.data.packing: true with a context group of {context} ranks: packed examples under "
                f"context parallelism are not built; set model.data.packing=false or context/ulysses size 1")
    return None


def stage_scheme(stage: str, lora: bool) -> str | None:
    """The peft stage trains LoRA adapters and nothing else; fine_tuning trains every weight (NeMo's split)."""
    from runtime.schema.reader import show

    if stage == "peft" and not lora:
        return ("peft.model.peft.peft_scheme: null in the peft stage, which trains LoRA adapters; set "
                "peft.model.peft.peft_scheme=lora (with lora_rank, lora_alpha, target_modules), or run "
                "stages=[fine_tuning] to train every weight")
    if stage == "fine_tuning" and lora:
        return (f"fine_tuning.model.peft.peft_scheme: {show('lora')} in the fine_tuning stage, which trains every "
                f"weight; use the peft stage for LoRA (stages=[peft] peft=<recipe>), or set "
                f"fine_tuning.model.peft.peft_scheme=null")
    return None


def fine_tuning_data(has_sft: bool, has_prefix: bool, p: str) -> str | None:
    if has_sft and has_prefix:
        return (f"{p}model.data: both data_prefix (pretraining) and train_ds (fine-tuning) are set; keep "
                f"train_ds.file_names for fine-tuning, or set model.data.train_ds=null to pretrain")
    return None


# ------------------------------------------------------------------------------------------------- stage flow
def trains_on_prepared_data(data_prefix: object, tokenizer: object, output_dir: object,
                            preparation: str) -> str | None:
    """With data_preparation and training in one launch, training must read what the preparation writes: a recipe
    pointing at another corpus (stages=[data_preparation,training] training=gpt3/5b prepares the demo corpus and
    would train on the_pile_gpt2) is a mistake found after the queue wait otherwise, or never."""
    out = os.path.normpath(str(output_dir or ""))
    if not out or out == ".":
        return None
    if isinstance(data_prefix, (list, tuple)):
        paths = [str(v) for v in data_prefix if isinstance(v, str)]
    else:
        paths = [str(data_prefix or "")]

    def inside(path: str) -> bool:
        return os.path.normpath(path) == out or os.path.normpath(path).startswith(out + os.sep)

    if all(inside(path) for path in paths if path):
        return None
    elsewhere = next(path for path in paths if path and not inside(path))
    if tokenizer and not inside(str(tokenizer)):
        also = f" and training.model.tokenizer.model={out}/tokenizer.json"
    else:
        also = ""
    return (f"training.model.data.data_prefix: {elsewhere!r} is not what data_preparation ({preparation}) writes "
            f"(it writes {out}); set training.model.data.data_prefix={out}/blend.txt{also}, choose the "
            f"data_preparation config that prepares {elsewhere!r}, or leave data_preparation out of stages")


# ------------------------------------------------------------------------------------------------ alignment
def preference_beta(beta: float, key: str) -> str | None:
    if beta <= 0:
        return (f"{key}: {beta} must be > 0 (how strongly the policy is held to the reference; NxD Training's "
                f"recipes use 0.01-0.1)")
    return None


def prompt_limit(limit: int, seq_length: int | None, key: str) -> str | None:
    if limit < 1:
        return f"{key}: {limit} must be a positive number of tokens"
    if seq_length is not None and limit >= seq_length:
        return (f"{key}: {limit} leaves no room for the response in a row of seq_length {seq_length}; set it "
                f"below seq_length (half of it is usual)")
    return None


def reference_source(precompute: bool, lora: bool, p: str) -> str | None:
    """Without precomputed references, the reference is the base model with its adapters switched off: only LoRA
    has one without holding a second model."""
    if not precompute and not lora:
        return (f"{p}model_alignment_strategy.dpo.precompute_ref_log_probs: false trains every weight, so the "
                f"reference would be a second model in memory; set it to true (computed once before training) or "
                f"use LoRA (model.peft.peft_scheme=lora)")
    return None


def alignment_layout(context: int, packing: bool | None, p: str) -> str | None:
    if context > 1:
        return (f"{p}model.context_parallel_size: a context group of {context} ranks in the alignment stage: a "
                f"pair's log-probabilities are summed over whole sequences; set context_parallel_size and "
                f"ulysses_parallel_size to 1")
    if packing:
        return (f"{p}model.data.packing: true in the alignment stage: each pair is its own two rows (chosen and "
                f"rejected side by side); remove model.data.packing or set it to false")
    return None


def alignment_stage(stage: str, strategies: tuple[str, ...]) -> str | None:
    """model_alignment_strategy.dpo/orpo belong to the alignment stage, which reads them."""
    if strategies and stage != "alignment":
        return (f"{stage}.model_alignment_strategy.{strategies[0]}: preference alignment runs in the alignment "
                f"stage; use stages=[alignment] alignment=<recipe>, or remove model_alignment_strategy.{strategies[0]}")
    return None


def checkpoint_name(name: str | None, key: str, directory_key: str) -> str | None:
    """A checkpoint_name names one checkpoint's directory inside checkpoint_dir (or 'latest'): a path, which could
    read any directory on the machine, is refused. Conversion and evaluation both take one."""
    if name is None:
        return None
    fix = "give one checkpoint's directory name in it (e.g. step_00000040.3f9c2a1b) or latest"
    if name.startswith("/") or ".." in name.split("/"):
        return f"{key}: {name!r} leaves {directory_key}; {fix}"
    if "/" in name or name in ("", "."):
        return f"{key}: {name!r} is not one directory name in {directory_key}; {fix}"
    return None


def checkpoint_config(text: str | bytes, path: str) -> tuple[dict | None, str | None]:
    """(the training config a checkpoint was saved with, None), or (None, one line naming its config.yaml) when the
    file is not YAML or not a mapping (edited by hand, damaged on disk). The launcher reads it at launch (a resume
    from another model's checkpoints), the conversion and evaluation stages on the node."""
    import yaml

    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(error, "problem", None) or error).split())[:60]
        return None, (f"{path}: not valid YAML{at} ({what}); it is the config this checkpoint was saved with: "
                      f"restore it from a copy, or move the checkpoint's directory aside to use the one before")
    if not isinstance(config, dict):
        return None, (f"{path}: holds {type(config).__name__}, not the config this checkpoint was saved with; restore "
                      f"it from a copy, or move the checkpoint's directory aside to use the one before")
    return config, None


_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
# AWS's "characters to avoid" in object keys, and '$': none is needed, and each misleads a shell or a URL parser.
_S3_KEY_AVOID = '\\{}^%`[]"<>~#|$'


def s3_uri(value: object, key: str, *, patterns: bool = False) -> str | None:
    """s3://<bucket>/<object key>: a bucket name S3 takes, and a key without spaces, control characters (a newline
    would end the line it is printed on) or the characters AWS says to avoid. `patterns`: a key may hold {:02d}
    patterns (data_preparation's input.files)."""
    text = "" if value is None else str(value)
    example = f"e.g. {key}=s3://my-bucket/nxdt/file"
    if not text.startswith("s3://"):
        return f"{key}: {text!r} is not an S3 URI; give s3://<bucket>/<key>, {example}"
    bucket, _, path = text[len("s3://"):].partition("/")
    if not _S3_BUCKET.fullmatch(bucket):
        return (f"{key}: {text!r}: {bucket[:63]!r} is not an S3 bucket name (lowercase letters, digits, '.' and '-', "
                f"at most 63); {example}")
    if not path.strip("/"):
        return f"{key}: {text} names a bucket without a key; add the object's path"
    avoid = _S3_KEY_AVOID.replace("{", "").replace("}", "") if patterns else _S3_KEY_AVOID
    if bad := next((c for c in path if not c.isprintable() or c.isspace() or c in avoid), None):
        return (f"{key}: {text!r} holds {bad!r}; an S3 key here takes no spaces, control characters or any of "
                f"{avoid} (AWS's characters to avoid): rename the object, {example}")
    return None


def s3_bucket(value: object, key: str) -> str | None:
    """A bare bucket name (cluster-config's s3_access)."""
    if _S3_BUCKET.fullmatch(str(value)):
        return None
    return (f"{key}: {str(value)[:63]!r} is not an S3 bucket name (lowercase letters, digits, '.' and '-', at most "
            f"63), e.g. {key}=[my-data-bucket]")
