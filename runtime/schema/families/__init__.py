# Model families: how a Hugging Face config.json of each model_type maps to our `model:` keys, which config.json an
# export of ours writes, and what each `model.architecture` network is made of. Every family is a folder of its own
# (runtime/families/<name>, found through runtime/schema/folder_families.py; docs/runtime.md, "Adding a model
# family"): its __init__ is the protocol (MODEL_TYPES, TIED_DEFAULT, model_keys, exports, refusal, hf_config) with
# ARCHITECTURE, and its VARIANTS are the other Hugging Face families of the same network. This registry imports no
# family of its own; base.py (HFConfig) and decoder.py (the Llama decoder's keys) beside it are the families' shared
# readers. Standard library only.
from __future__ import annotations

from types import ModuleType
from typing import Any

from runtime.schema.folder_families import export_order, folder_family, folder_family_modules, hf_families
from runtime.schema.architecture import Architecture
from runtime.schema.families.base import HFConfig

# Every model.architecture, each folder family's ARCHITECTURE (runtime/families/<name>).
ARCHITECTURES: dict[str, Architecture] = {family.ARCHITECTURE.name: family.ARCHITECTURE
                                          for family in folder_family_modules()}


def architecture(name: Any) -> Architecture:
    """The registry's entry for `name`; ValueError naming the choices (the schema has refused an unknown one before
    anything asks)."""
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(f"model.architecture={name!r} is not one of {', '.join(ARCHITECTURES)}") from None


def known_architecture(name: Any) -> Architecture | None:
    """The registry's entry for `name`, or None when it is not one (the rules judging another key skip it: the
    architecture's own key names the mistake)."""
    return ARCHITECTURES.get(name) if isinstance(name, str) else None


def megatron_architecture(switches: tuple) -> str | None:
    """The architecture a NeMo / NxD megatron file's four switches name, or None."""
    return next((a.name for a in ARCHITECTURES.values() if switches in a.megatron), None)


def megatron_choices() -> str:
    """Every combination of the four switches built here, for the line that refuses another."""
    return " or ".join(f"{a.name} ({', '.join(map(str, combo))})" for a in ARCHITECTURES.values()
                       for combo in a.megatron[:1])


# The vocabularies of the families' tokenizers the recipes name, by the name their paths hold (the estimator's, on a
# machine without the tokenizer file).
TOKENIZER_VOCABULARIES = {"llama3": 128256, "llama2": 32000, "gpt2": 50257, "qwen2_5": 151665, "qwen3": 151669}
# A Hugging Face file (model.model_config decides the network) sits on the decoder's smallest recipe.
HF_BASE = ARCHITECTURES["llama"]

# In export order (runtime/families EXPORT_ORDER, each folder's VARIANTS before its own): the first whose exports(cfg)
# holds writes the config.json.
FAMILIES: tuple[ModuleType, ...] = tuple(hf for name in export_order() for hf in hf_families(folder_family(name)))
HF_MODEL_TYPES: tuple[str, ...] = tuple(t for family in FAMILIES for t in family.MODEL_TYPES)


def family_of_model_type(model_type: Any) -> ModuleType:
    for family in FAMILIES:
        if model_type in family.MODEL_TYPES:
            return family
        if problem := getattr(family, "REFUSED_MODEL_TYPES", {}).get(model_type):  # a folder family's neighbour
            raise ValueError(f"config.json model_type={model_type!r}: {problem}")
    raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {list(HF_MODEL_TYPES)}")


def import_keys(hf_config: dict) -> tuple[dict[str, Any], bool]:
    """config.json -> (the family's `model:` keys, tie_word_embeddings' default for it)."""
    hf = HFConfig(hf_config)
    family = family_of_model_type(hf.model_type)
    return family.model_keys(hf), family.TIED_DEFAULT


# The families torchtitan 0.3 builds as we build them (docs/torchtitan.md): a family module's TORCHTITAN names
# torchtitan's model (torchtitan.models.<name>), built by its folder's titan.py. A model of another family runs on our
# runtime only: launcher/titan.py refuses it at launch, checkpoint conversion refuses it too.
TORCHTITAN_MODELS: dict[str, str] = {family.__name__.rsplit(".", 1)[-1]: family.TORCHTITAN
                                     for family in FAMILIES if getattr(family, "TORCHTITAN", None)}


def torchtitan_model(cfg) -> str | None:
    """torchtitan's model for `cfg`'s family (TORCHTITAN_MODELS), or None when torchtitan has none of it."""
    family = family_for(cfg)
    return getattr(family, "TORCHTITAN", None) if family is not None else None


def torchtitan_builder(name: str) -> str:
    """The module that builds torchtitan's model `name` (a TORCHTITAN_MODELS value): the titan.py of the folder of
    the family that names it (runtime/families/<folder>/titan.py)."""
    for family in FAMILIES:
        if getattr(family, "TORCHTITAN", None) == name:
            return ".".join(family.__name__.split(".")[:3]) + ".titan"
    raise ValueError(f"family: {name!r} is not one torchtitan trains here; choose one of "
                     f"{', '.join(sorted(TORCHTITAN_MODELS.values()))}")


def family_for(cfg) -> ModuleType | None:
    """The family whose config.json and weight names `cfg` has (what an export writes and an import reads)."""
    return next((f for f in FAMILIES if f.exports(cfg)), None)


def export_family(cfg) -> ModuleType:
    """The family an export of `cfg` is written as; ValueError names the key when none computes it exactly (a model
    trained with choices its family's transformers class does not make: token dropping, a sigmoid router, ...)."""
    family = family_for(cfg)
    if family is None:  # every combination of ModelConfig's switches has a family today; a new switch may not
        raise ValueError("no Hugging Face family here computes this model; see docs/runtime.md, Adding a model family")
    if problem := family.refusal(cfg):
        raise ValueError(problem)
    return family


__all__ = ["ARCHITECTURES", "Architecture", "FAMILIES", "HF_MODEL_TYPES", "HFConfig", "architecture", "export_family",
           "family_for", "family_of_model_type", "import_keys", "known_architecture", "megatron_architecture",
           "megatron_choices", "HF_BASE", "TORCHTITAN_MODELS",
           "TOKENIZER_VOCABULARIES", "torchtitan_builder", "torchtitan_model"]
