"""What an imported file leaves out, and what fills it in: the base recipe it sits on (and the keys our recipes
set, which a NeMo-Launcher file may use as they are), the architecture a megatron file's switches name, and NxD
Training's own defaults for its megatron and MoE models where ours differ. Rows for each, so that explain-config
shows every value that will run.
"""

from __future__ import annotations

from typing import Any

from launcher.nxdt_keys import (MEGATRON_DEFAULTS, MEGATRON_SWITCH_DEFAULTS, MEGATRON_SWITCHES, NXD_MOE_DEFAULTS,
                                flatten)
from runtime.schema.families import ARCHITECTURES, HF_BASE, megatron_architecture, megatron_choices


def file_architecture(flat: dict[str, Any]) -> tuple[str | None, tuple[str, str, str]]:
    """A megatron file's four switches -> (our model.architecture or None, the row that says why)."""
    values = tuple(flat.get(key, default) for key, default in zip(MEGATRON_SWITCHES, MEGATRON_SWITCH_DEFAULTS))
    architecture = megatron_architecture(values)
    key = f"model.{{{', '.join(key.removeprefix('model.') for key in MEGATRON_SWITCHES)}}}"
    shown = ", ".join(map(str, values))
    if architecture is None:
        return None, (key, shown, f"{key}: {shown} is no architecture built here: {megatron_choices()}; set "
                                  f"the four to one of them")
    return architecture, (f"(implied) {key}", shown, f"training.model.architecture = {architecture!r}")


def megatron_defaults(flat: dict[str, Any], training: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """NxD's megatron model's values for the keys a file leaves out, and its vocabulary padding (a multiple of
    make_vocab_size_divisible_by x tensor_model_parallel_size, as its data module pads), put into `training`."""
    model = training.setdefault("model", {})
    rows = []
    for key, value in MEGATRON_DEFAULTS.items():
        if key not in model:
            model[key] = value
            rows.append((f"(not in the file) {key}", value, f"training.model.{key} = {value!r}, NxD Training's "
                                                            f"megatron default"))
    divisor, tp = model.get("make_vocab_size_divisible_by") or 128, model.get("tensor_model_parallel_size") or 1
    model["make_vocab_size_divisible_by"] = divisor * tp
    rows.append(("(implied) model.make_vocab_size_divisible_by x tensor_model_parallel_size", f"{divisor} x {tp}",
                 f"training.model.make_vocab_size_divisible_by = {divisor * tp}: NxD Training's megatron data "
                 f"module pads the vocabulary to a multiple of both"))
    return rows


def with_base(training: dict[str, Any], data: dict[str, Any], stage: str = "training") -> dict[str, Any]:
    """On top of the family's smallest recipe (run keys, checkpoint defaults, data splits): the file's keys, and
    nulls for every shape key that config.json (model.model_config) supplies, so nothing of the base's shape
    leaks into the imported model. A fine-tuning file sits on <stage>/llama/tiny, without its demo data."""
    model = training.setdefault("model", {})
    architecture = model.get("architecture")  # a megatron file's; an hf file's comes from its model_config
    if architecture is None and "model_config" not in model:  # a megatron file named for its network
        architecture = next((name for name in ARCHITECTURES if name in str(data.get("name", ""))), None)
    family = ARCHITECTURES.get(architecture, HF_BASE).tiny_recipe
    if stage != "training":
        # An alignment file sits on the tiny recipe of its strategy: the other's section would be a second strategy.
        family = f"llama/tiny_{training['strategy']}" if stage == "alignment" else "llama/tiny"
        model.setdefault("restore_from_path", None)
        sft = model.setdefault("data", {})
        sft.setdefault("train_ds", {}).setdefault("file_names", [])
        sft.setdefault("validation_ds", {}).setdefault("file_names", [])
    training.setdefault("trainer", {})["accelerator"] = "neuron"  # NxD Training runs on Trainium
    if "model_config" in model:
        for key in ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "add_qkv_bias", "qk_layernorm", "rope_scaling", "rotary_base",
                    "layernorm_epsilon", "share_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                    "max_position_embeddings"):
            model.setdefault(key, None)
        tokenizer = model.setdefault("tokenizer", {})
        tokenizer.setdefault("model", None)
    seq = model.get("encoder_seq_length") or (model.get("data") or {}).get("seq_length")
    if seq is not None:
        model.setdefault("encoder_seq_length", seq)
        model.setdefault("data", {}).setdefault("seq_length", seq)
    model.setdefault("data", {}).setdefault("data_prefix", None)
    # NxD Training's own defaults where the base recipe's would differ: decay to 0, no time limit of its own.
    sched = model.setdefault("optim", {}).setdefault("sched", {})
    sched.setdefault("min_lr", 0.0)
    sched.setdefault("constant_steps", 0)
    training.setdefault("run", {}).setdefault("time_limit", "UNLIMITED")
    if model.get("virtual_pipeline_model_parallel_size") == 1:
        model["virtual_pipeline_model_parallel_size"] = None  # NxD writes 1 for "no interleaving"
    return {"defaults": [f"/{stage}/{family}@_here_", "_self_"], **training}


def nxd_moe_defaults(training: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """NxD Training's values for the model.moe keys a file with model.moe leaves out (ours differ: top_k 2,
    dropless, no auxiliary loss), put into `training`; rows for explain-config."""
    moe = (training.get("model") or {}).get("moe")
    if not isinstance(moe, dict):
        return []
    rows = []
    for key, value in NXD_MOE_DEFAULTS.items():
        if key not in moe:
            moe[key] = value
            rows.append((f"(not in the file) model.moe.{key}", value,
                         f"training.model.moe.{key} = {value!r}, NxD Training's default"))
    return rows


def from_base(training: dict[str, Any], stage: str = "training") -> list[tuple[str, Any, str]]:
    """Rows for the keys the file leaves to the base recipe, so explain-config shows every value that will run."""
    from omegaconf import OmegaConf

    from launcher.paths import conf_dir

    recipe = training["defaults"][0].removeprefix("/").removesuffix("@_here_")  # e.g. training/llama/tiny
    chain, seen = [recipe], {}
    while chain:  # the recipe's own defaults first, then the recipe over them
        name = chain.pop()
        data = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{name}.yaml"), resolve=False)
        parents = [d.removeprefix("/").removesuffix("@_here_") for d in data.get("defaults", [])
                   if isinstance(d, str) and d.startswith("/") and d.endswith("@_here_")]
        seen = {**flatten({k: v for k, v in data.items() if k != "defaults"}), **seen}
        chain += parents
    given = flatten({k: v for k, v in training.items() if k != "defaults"})
    return [(f"(not in the file) {key}", value, f"{stage}.{key}, from the base recipe {recipe}")
            for key, value in sorted(seen.items()) if key not in given]


def our_keys() -> set[str]:
    """Every training key our reference recipes set, plus the schema's optional ones (Megatron's names, as NeMo's:
    kv_channels is the head size, null for hidden_size / num_attention_heads; ffn_dropout the MLP's dropout; SGD's
    momentum, dampening and nesterov, torch.optim.SGD's names as NeMo's optim section passes them on)."""
    from omegaconf import OmegaConf

    from launcher.paths import conf_dir

    keys = {"model.num_query_groups", "model.rotary_base", "model.model_config", "model.kv_channels",
            "model.add_qkv_bias", "model.qk_layernorm", "model.pipeline_cuts", "model.data.reset_position_ids",
            "model.data.reset_attention_mask", "model.ffn_dropout", "model.optim.momentum", "model.optim.dampening",
            "model.optim.nesterov"}
    for recipe in ("training/gpt3/tiny", "training/llama/tiny", "fine_tuning/llama/tiny", "peft/llama/tiny"):
        data = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{recipe}.yaml"), resolve=False)
        keys |= set(flatten({k: v for k, v in data.items() if k != "defaults"}))
    return keys - {"run.results_dir"}  # nemo_config.IGNORED says why

