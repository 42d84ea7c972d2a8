"""NeMo-Launcher training YAML files (e.g. its conf/training/gpt3/5b.yaml) as they are, through the same
`training=@FILE` as NxD Training's (launcher/nxdt_config.py decides which kind a file is).

A NeMo-Launcher file already speaks our keys: those pass through unchanged, with their `${base_results_dir}`,
`${data_dir}` and `${training...}` interpolations resolved in the launch config, as NeMo-Launcher resolves them.
NeMo-only keys are ignored (with the reason) when their value changes nothing here, and refused when it would.
NeMo-Launcher's fine_tuning and peft files (model.restore_from_path, model.data.train_ds / validation_ds,
model.peft) speak our keys too, apart from LoRA's sizes under model.peft.lora_tuning, which are mapped.

What each NeMo key becomes is tabled in launcher/nemo_keys.py; map_keys here sorts a file's keys by those tables
and by the functions below that each own a group of keys; launcher/nemo_targets.py gives a training file the
Trainium layouts of our recipe for its model.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from launcher.nemo_keys import IGNORED, LORA_MAPPED, OVERLAP, PEFT_SCHEMES, PRECISIONS, RUN_NAMING, SWITCHES
from launcher.nemo_targets import trainium_targets
from runtime.schema.families import megatron_architecture, megatron_choices


def is_nemo(data: dict[str, Any]) -> bool:
    """NeMo-Launcher's training files have run/trainer/model with the layout keys under model."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    return "distributed_strategy" not in data and "model_source" not in data and \
        ("hydra" in data or "run" in data) and "tensor_model_parallel_size" in model


def nemo_stage(data: dict[str, Any]) -> tuple[str, str]:
    """The stage a NeMo-Launcher file configures, and the key that says so: LoRA (model.peft.peft_scheme: lora) is
    the peft stage; starting weights or chat data (model.restore_from_path, model.data.train_ds) fine_tuning."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    peft = model.get("peft") if isinstance(model.get("peft"), dict) else {}
    if str(peft.get("peft_scheme")).lower() == "lora":
        return "peft", "model.peft.peft_scheme: lora"
    data = model.get("data") if isinstance(model.get("data"), dict) else {}
    if model.get("restore_from_path") is not None:
        return "fine_tuning", "model.restore_from_path"
    if data.get("train_ds") is not None:
        return "fine_tuning", "model.data.train_ds"
    return "training", ""


def map_keys(flat: dict[str, Any], ours: set[str], put, row, error, warn_key) -> None:
    """Sort every key of a flattened NeMo file: ours (unchanged), mapped, ignored or refused. A training file whose
    model is one of our recipes' also gets that recipe's Trainium layouts (`targets`)."""
    amp_o2 = bool(flat.get("model.megatron_amp_O2", False))
    mapped: dict[str, Any] = {}  # what the file becomes, for its Trainium layouts
    refused: list[str] = []

    def keep(key: str, value: Any) -> None:
        mapped[key] = value
        put(key, value)

    def refuse(key: str, why: str) -> None:
        refused.append(key)
        error(key, why)

    handled = set()
    for group in (_defaults, _architecture, _tokenizer, _moe, _rope_scaling, _fine_tuning_data, _lora_defaults):
        handled |= group(flat, keep, row, refuse, warn_key)
    for key, value in flat.items():
        if key in handled:
            continue
        if key in RUN_NAMING:
            keep(key, value)
            row(key, value, "kept: NeMo-Launcher names the run with it")
        elif key in LORA_MAPPED:
            keep(LORA_MAPPED[key], value)
            row(key, value, f"training.{LORA_MAPPED[key]}")
        elif key in OVERLAP:  # on by default here, as in NeMo: only a false is written
            if value is False:
                keep(OVERLAP[key], False)
            row(key, value, f"training.{OVERLAP[key]}" if value is False else
                f"the default here (training.{OVERLAP[key]}: true)")
        elif key == "model.peft.peft_scheme":
            if value not in PEFT_SCHEMES:
                refuse(key, f"{value!r} is not built here: LoRA (lora) is, or none for full fine-tuning")
                continue
            keep(key, PEFT_SCHEMES[value])
            row(key, value, f"training.{key}")
        elif key == "model.restore_from_path" and (str(value).endswith(".nemo") or value == "???"):
            what = "a .nemo archive is not read here" if value != "???" else "is required (NeMo's ???)"
            refuse(key, f"{value!r}: {what}; give the Hugging Face model directory it was converted from, or a "
                        "checkpoint of ours")
        elif key == "trainer.precision":
            target = PRECISIONS.get((value, amp_o2))
            if target is None:
                refuse(key, f"{value!r} has no counterpart here (fp16 is not supported); use bf16 or 32")
                continue
            keep("precision.type", target)
            row(key, value, f"training.precision.type = {target!r}")
        elif key == "model.precision":  # NeMo copies trainer.precision here
            if value != flat.get("trainer.precision"):
                refuse(key, f"{value!r} differs from trainer.precision {flat.get('trainer.precision')!r}; NeMo "
                            "trains in trainer.precision: make them equal")
                continue
            row(key, value, "the same as trainer.precision")
        elif key == "model.optim.name" and value in ("distributed_fused_adam", "mcore_distributed_optim"):
            # AdamW whose state is sharded over data parallelism (apex's, or Megatron-core's distributed
            # optimizer in the current files): AdamW with ZeRO-1 here.
            keep("model.optim.name", "adamw")
            keep("model.zero1", True)
            row(key, value, "training.model.optim.name = 'adamw' and training.model.zero1 = True")
        elif key == "model.fsdp":
            _fsdp(flat, value, keep, refuse, row)
        elif key == "model.resume_from_checkpoint":
            keep("exp_manager.resume_from_checkpoint", value)
            row(key, value, "training.exp_manager.resume_from_checkpoint")
        elif key in ours:
            keep(key, value)
            row(key, value, f"training.{key}")
        elif (entry := longest_prefix(key, IGNORED)) is not None:
            fine, why = IGNORED[entry]
            if fine is None or value in fine:
                row(key, value, "ignored: " + why)
                warn_key(key)
            else:
                refuse(key, f"{value!r} is not supported ({why}); remove it or use {' or '.join(map(repr, fine))}")
        else:
            refuse(key, "is not a key nxdt-launch knows")
    if not refused and not _fine_tuning(flat):
        trainium_targets(flat, mapped, put, row)


# Each function below owns a group of keys: it maps or refuses them and returns the keys it owned.

def _defaults(flat, put, row, error, warn_key) -> set[str]:
    """NeMo's defaults list: `_self_`, and `tp_overlap@model.ub_tp_comm_overlap_cfg` (its userbuffer overlap tuning,
    an implementation choice); any other entry composes a NeMo config this file does not show."""
    if "defaults" not in flat:
        return set()
    entries = flat["defaults"] if isinstance(flat["defaults"], list) else [flat["defaults"]]
    others = [e for e in entries if e != "_self_" and "tp_overlap@model.ub_tp_comm_overlap_cfg" not in str(e)]
    if others:
        error("defaults", f"{others!r} composes NeMo configs whose keys this file does not show, which are not read "
                          "here: copy their keys into the file and remove those entries")
    else:
        row("defaults", flat["defaults"], "ignored: the userbuffer overlap tuning NeMo composes (tp_overlap)")
        warn_key("defaults")
    return {"defaults"}


# NeMo's four architecture switches (SWITCHES, launcher/nemo_keys.py) -> our model.architecture.
def _architecture(flat, put, row, error, warn_key) -> set[str]:
    values = tuple(flat.get(key, default) for key, default in SWITCHES.items())
    architecture = megatron_architecture(values)
    present = [key for key in SWITCHES if key in flat]
    if architecture is None:
        error(present[0], f"with {', '.join(present[1:])}: {values} is no architecture built here: "
                          f"{megatron_choices()}; set the four to one of them")
        return set(present)
    put("model.architecture", architecture)
    for key in present:
        row(key, flat[key], f"with the other switches: training.model.architecture = {architecture!r}")
    return set(present)


TOKENIZER = ("model.tokenizer.library", "model.tokenizer.type", "model.tokenizer.model",
             "model.tokenizer.vocab_file", "model.tokenizer.merge_file")


def _tokenizer(flat, put, row, error, warn_key) -> set[str]:
    """NeMo's tokenizer -> one Hugging Face tokenizer.json (model.tokenizer.model): GPT-2's BPE (vocab_file +
    merge_file) and a SentencePiece .model as the tokenizer.json beside them, a Hugging Face tokenizer by its
    directory, or by its hub name under ${data_dir} (nothing here downloads it: a dry run says it is missing)."""
    library, kind, model = (flat.get(key) for key in TOKENIZER[:3])
    vocab = flat.get("model.tokenizer.vocab_file")
    present = {key for key in TOKENIZER if key in flat}
    if not present:
        return set()
    if library == "megatron" and kind == "GPT2BPETokenizer" and vocab:
        path, how = _beside(vocab), ("GPT-2's BPE (vocab_file + merge_file) is read as one tokenizer.json beside "
                                     "vocab_file; stages=[data_preparation] writes it from the two")
    elif library == "sentencepiece" and model:
        path, how = _beside(model), ("a SentencePiece .model is read as the tokenizer.json beside it; write it with "
                                     "transformers: LlamaTokenizerFast(vocab_file=MODEL).save_pretrained(DIR)")
    elif library == "huggingface" and (kind or model):
        name = str(kind or model)
        if _hub_name(name):
            path = f"${{data_dir}}/{name}/tokenizer.json"
            how = (f"{name!r} is a Hugging Face hub name, which nothing here downloads: `huggingface-cli download "
                   f"{name} tokenizer.json --local-dir <data_dir>/{name}`, or set training.model.tokenizer.model")
        else:
            path, how = (name if name.endswith(".json") else f"{name}/tokenizer.json"), "the tokenizer's directory"
    else:
        error(sorted(present)[0], f"{library!r} / {kind!r}: nxdt-launch reads a Hugging Face tokenizer.json; set "
                                  "model.tokenizer.library: huggingface and type to its directory")
        return present
    put("model.tokenizer.library", "huggingface")
    put("model.tokenizer.model", path)
    for key in sorted(present):
        row(key, flat[key], f"with the tokenizer's other keys: training.model.tokenizer.model = {path!r} ({how})")
    return present


def _beside(path: Any) -> str:
    return str(PurePosixPath(str(path)).parent / "tokenizer.json")


def _hub_name(name: str) -> bool:
    """`org/model` as the Hugging Face hub names a repository: not a path here."""
    return not name.startswith(("/", ".", "~", "$")) and name.count("/") == 1 and "://" not in name


def _moe(flat, put, row, error, warn_key) -> set[str]:
    """Megatron-core's moe_* keys -> model.moe. Its router takes the top-k of the logits and softmaxes them
    (normalized affinities); with an expert capacity (moe_pad_expert_input_to_capacity) tokens past it drop."""
    keys = {key for key in flat if key.startswith(("model.num_moe_experts", "model.moe_"))} - set(IGNORED)
    if not keys:
        return set()
    capacity = flat.get("model.moe_expert_capacity_factor")
    moe = {"num_experts": flat.get("model.num_moe_experts"), "top_k": flat.get("model.moe_router_topk", 2),
           "frequency": 1, "capacity_factor": capacity, "dropless": capacity is None,
           "router_aux_loss_coef": flat.get("model.moe_aux_loss_coeff", 0.0),
           "router_z_loss_coef": flat.get("model.moe_z_loss_coeff") or 0.0,
           "normalize_top_k_affinities": True, "router_activation": "softmax"}
    known = {"model.num_moe_experts", "model.moe_router_topk", "model.moe_expert_capacity_factor",
             "model.moe_aux_loss_coeff", "model.moe_z_loss_coeff", "model.moe_pad_expert_input_to_capacity"}
    # The expert bias (aux-loss-free balancing: our model.moe.score_bias and router_bias_update_rate) is built for
    # the architectures whose MoE has a selection bias, from their config.json; Megatron ignores the rate without it.
    expert_bias = {"model.moe_router_enable_expert_bias", "model.moe_router_bias_update_rate"}
    if flat.get("model.moe_router_enable_expert_bias"):
        error("model.moe_router_enable_expert_bias", "True: the expert selection bias is not built "
              "for a NeMo file's Mixtral-style MoE; import the model's config.json (training.model.model_config) and "
              "set training.model.moe.router_bias_update_rate, or set it to False")
    for key in sorted(keys & expert_bias if not flat.get("model.moe_router_enable_expert_bias") else ()):
        row(key, flat[key], "ignored: Megatron-core updates the expert bias only with "
                            "moe_router_enable_expert_bias: True")
    keys_mapped = keys - expert_bias
    for key in sorted(keys_mapped - known):
        error(key, "is a Megatron-core MoE key nxdt-launch does not know; remove it")
    if capacity is not None and flat.get("model.moe_pad_expert_input_to_capacity") is not True:
        error("model.moe_expert_capacity_factor", f"{capacity!r} without moe_pad_expert_input_to_capacity: True "
                                                  "(capacity that varies by batch) is not built; set it to True")
    for name, value in moe.items():
        put(f"model.moe.{name}", value)
    for key in sorted(keys_mapped & known):
        row(key, flat[key], "with the other moe_* keys: training.model.moe = " + repr(moe))
    return keys


# NeMo's scale_positional_embedding: Llama 3.1's RoPE scaling, as Hugging Face's config.json writes it.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _rope_scaling(flat, put, row, error, warn_key) -> set[str]:
    key = "model.scale_positional_embedding"
    if key not in flat:
        return set()
    if flat[key]:
        put("model.rope_scaling", dict(LLAMA31_ROPE))
    row(key, flat[key], f"training.model.rope_scaling = {LLAMA31_ROPE!r}" if flat[key] else "the default here")
    return {key}


# A fine-tuning split's keys that describe NeMo's own records (its squad .jsonl: input / output fields joined by a
# prompt template) and how its loader treats them.
RECORD_KEYS = ("context_key", "label_key", "prompt_template", "add_eos", "add_bos", "add_sep",
               "separate_prompt_and_response_with_newline", "truncation_field", "names", "metric", "shuffle",
               "num_workers", "memmap_workers", "pin_memory", "min_seq_length", "drop_last",
               "concat_sampling_probabilities", "index_mapping_dir", "write_predictions_to_file",
               "output_file_path_prefix", "tokens_to_generate", "global_batch_size", "micro_batch_size",
               "max_seq_length")


def _fine_tuning_data(flat, put, row, error, warn_key) -> set[str]:
    """model.data.{train,validation,test}_ds: the files and the sequence length are ours; NeMo's own records
    (context_key / label_key / prompt_template) are not read here: one line says how to convert them."""
    splits = ("model.data.train_ds.", "model.data.validation_ds.", "model.data.test_ds.")
    keys = {key for key in flat if key.startswith(splits) or key == "model.data.chat"}
    if not keys:
        return set()
    if flat.get("model.data.chat"):
        error("model.data.chat", "True: NeMo's chat records are not read here; write them as {\"messages\": [...]} "
                                 "records (.jsonl) and set it to False")
    length = flat.get("model.data.train_ds.max_seq_length")
    if isinstance(length, int):
        put("model.encoder_seq_length", length)
        put("model.data.seq_length", length)
        row("model.data.train_ds.max_seq_length", length, "training.model.encoder_seq_length and data.seq_length")
    template = {field: flat.get(f"model.data.train_ds.{field}") for field in ("context_key", "label_key",
                                                                              "prompt_template")}
    if any(template.values()):
        first = "model.data.train_ds.file_names" if "model.data.train_ds.file_names" in keys else sorted(keys)[0]
        error(first, f"holds NeMo's own records ({', '.join(f'{k} {v!r}' for k, v in template.items())}), which are "
                     "not read here: the fine_tuning and peft stages read .jsonl chat records {\"messages\": [...]} "
                     "or prompt/completion records; convert each file, e.g. `jq -c '{prompt: (.input + \" \"), "
                     "completion: .output}' train-v1.1_gpt.json > train.jsonl`, and list the new files in "
                     "model.data.train_ds.file_names and validation_ds.file_names")
        return keys
    for key in sorted(keys):
        field = key.rsplit(".", 1)[1]
        if field == "file_names" and not key.startswith(splits[2]):
            put(key, flat[key])
            row(key, flat[key], f"training.{key}")
        elif field in RECORD_KEYS or key.startswith(splits[2]) or ".metric." in key:
            row(key, flat[key], "ignored: how NeMo's loader reads its records; the test split is the evaluation "
                                "stage's")
            warn_key(key)
        else:
            error(key, "is not a key nxdt-launch knows")
    return keys


def _lora_defaults(flat, put, row, error, warn_key) -> set[str]:
    """What NeMo's LoRA does when the file leaves a size out: adapters on the fused QKV, alpha = adapter_dim."""
    if str(flat.get("model.peft.peft_scheme")).lower() != "lora":
        return set()
    tuning = "model.peft.lora_tuning."
    if f"{tuning}target_modules" not in flat:
        put("model.peft.target_modules", ["attention_qkv"])
        row(f"(not in the file) {tuning}target_modules", None, "training.model.peft.target_modules = "
                                                                "['attention_qkv'], NeMo's default")
    if f"{tuning}alpha" not in flat and f"{tuning}adapter_dim" in flat:
        put("model.peft.lora_alpha", flat[f"{tuning}adapter_dim"])
        row(f"(not in the file) {tuning}alpha", None, "training.model.peft.lora_alpha = adapter_dim, NeMo's default")
    return set()


def _fine_tuning(flat: dict[str, Any]) -> bool:
    """What nemo_stage reads: a fine_tuning or peft file, whose layout is its own on every cluster."""
    return str(flat.get("model.peft.peft_scheme")).lower() == "lora" or \
        flat.get("model.restore_from_path") is not None or any(k.startswith("model.data.train_ds.") for k in flat)


def longest_prefix(key: str, table) -> str | None:
    """The entry of `table` that is `key` or its nearest parent (`a.b.c` -> `a.b.c`, else `a.b`, else `a`)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return ".".join(parts[:i])
    return None


# NeMo's FSDP strategies (model.fsdp_sharding_strategy) as our ZeRO stages: `full` shards the weights (ZeRO-3),
# `grad` the gradients and optimizer state (ZeRO-2), `hybrid` the weights within a node, replicated across nodes.
FSDP_STAGES = {"full": 3, "grad": 2, "hybrid": 3}


def _fsdp(flat: dict[str, Any], value: Any, keep, refuse, row) -> None:
    """model.fsdp (with model.fsdp_sharding_strategy) as model.zero_stage, and a node's shard group for hybrid."""
    strategy = flat.get("model.fsdp_sharding_strategy", "full")
    stage = FSDP_STAGES.get(strategy) if value else None
    if value and stage is None:
        refuse("model.fsdp_sharding_strategy", f"{strategy!r} is not one of NeMo's FSDP strategies; use full, grad "
                                               f"or hybrid")
        return
    if stage is not None:
        keep("model.zero_stage", stage)
        if strategy == "hybrid":  # sharded within a node, replicated across nodes
            keep("model.data_parallel_shard_degree", _node_dp(flat))
    row("model.fsdp", value, f"training.model.zero_stage = {stage} (ZeRO-{stage}; docs/runtime.md, ZeRO stages)"
        if stage is not None else "ignored: plain data parallelism (the default)")


def _node_dp(flat: dict[str, Any]) -> int:
    """A node's data-parallel ranks: its devices over the tensor-parallel size (NeMo's hybrid shards within one)."""
    devices = flat.get("trainer.devices") or 1
    tp = flat.get("model.tensor_model_parallel_size") or 1
    return max(1, int(devices) // int(tp))
