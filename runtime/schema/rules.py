# Every pure rule on a stage config, written once. The launcher runs them at launch and at --dry-run, the
# runtime's loaders run them again on the node, and ParallelDims / ModelConfig / LRSchedule call them for
# configs built in code: each rule has one definition and one message.
#
# A rule takes typed values and returns None, or one line that starts with the key to change and says the fix.
# `p` is the stage's key prefix ("training." for the training stage), so messages name the override to type.
#
# The rules live by the part of the config they check, each module read whole: this one holds the run section,
# names and paths, the data_preparation input and the stage flow (what reaches a job script or joins stages);
# rules_layout.py how the world, the batch, the layers and the sequence split; rules_model.py the model's shape
# and vocabulary; rules_moe.py mixture-of-experts layers; rules_optim.py the optimizer, schedule and trainer;
# rules_tuning.py fine-tuning and alignment; rules_storage.py S3 and checkpoint names. Each is imported back here,
# so every rule is rules.<name> to its callers.
from __future__ import annotations

import os
import re

from runtime.schema.rules_layout import (  # noqa: F401
    world_divisible, world_text, elastic_nodes, tp_within_node, global_batch, interleaved_micro_batches, virtual_needs_pipeline,
    layers_split, stage_layers, CONTEXT_KEYS, context_kind, context_layout, context_sequence, ulysses_heads,
    context_architecture, ZERO_STAGES, zero_stage, zero3_on_xla, shard_degree,
)
from runtime.schema.rules_model import (  # noqa: F401
    head_size, MODEL_SWITCHES, LAYER_TYPES, llama_switches, attention_layers,
    context_window, rope_scaling, heads_groups, heads_tp, ffn_tp, kv_heads_tp, padded_vocab_size, vocab_tp,
    unpadded_vocab, positions, data_seq_length, DROPOUTS, dropout, MAX_VOCAB, vocab_rows, VOCAB_TENSORS,
    weights_vocab, tokenizer_fits,
)
from runtime.schema.rules_moe import (  # noqa: F401
    moe, bias_update, expert_layout, ep_divides_dp, ep_divides_experts, dropless_on_xla,
)
from runtime.schema.rules_optim import (  # noqa: F401
    betas, learning_rate, optimizer_options, optimizer_layout, min_lr, schedule_fits, schedule_holds,
    val_check_whole, splits, save_top_k,
)
from runtime.schema.rules_tuning import (  # noqa: F401
    lora_rank, lora_alpha, lora_dropout, lora_modules, lora_targets, lora_moe, document_reset, document_reset_eod,
    packing_context, stage_scheme, fine_tuning_data, preference_beta, prompt_limit, reference_source,
    alignment_layout, alignment_stage, reward_layout, reward_stage,
)
from runtime.schema.rules_storage import (  # noqa: F401
    endpoint_url, checkpoint_name, checkpoint_config, s3_uri, s3_bucket,
)

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


def peer_state_interval(ft, checkpoint, p: str) -> str | None:
    """The peer copies (fault_tolerance.peer_state_every_n_steps) are what a restart resumes from before the disk's
    checkpoints: saved less often than those, a restart would go back further than the disk's newest."""
    if ft is None or checkpoint is None or not ft.peer_state_every_n_steps:
        return None
    every = checkpoint.every_n_train_steps if checkpoint.enabled else 0
    if every and ft.peer_state_every_n_steps > every:
        return (f"{p}fault_tolerance.peer_state_every_n_steps: {ft.peer_state_every_n_steps} is more than "
                f"exp_manager.checkpoint_callback_params.every_n_train_steps ({every}): the copies in the peers' "
                f"memory would be older than the newest checkpoint on disk; use at most {every}")
    return None


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
