# Model families: how a Hugging Face config.json of each model_type maps to our `model:` keys, and which
# config.json an export of ours writes. One module per family (torchtitan keeps each model's definition and HF
# mapping together); adding one is a module with MODEL_TYPES, TIED_DEFAULT, model_keys, exports, refusal and
# hf_config, plus a line in FAMILIES (docs/runtime.md, "Adding a model family"). The network itself is shared:
# every family here is GPT-2's block or the Llama decoder with ModelConfig's switches (biases, per-head norms, a
# head size of its own, RoPE scaling, MoE). Standard library only.
from __future__ import annotations

from types import ModuleType
from typing import Any

from runtime.families import gpt_oss
from runtime.schema.families import gpt2, llama, mixtral, qwen2, qwen3, qwen3_moe
from runtime.schema.families.base import HFConfig

# In export order: the first whose exports(cfg) holds writes the config.json.
FAMILIES: tuple[ModuleType, ...] = (gpt_oss, gpt2, qwen3_moe, mixtral, qwen3, qwen2, llama)
HF_MODEL_TYPES: tuple[str, ...] = tuple(t for family in FAMILIES for t in family.MODEL_TYPES)
# The model.architecture of each folder family (runtime/families/<name>), after gpt and llama.
FOLDER_ARCHITECTURES: tuple[str, ...] = tuple(f.ARCHITECTURE for f in FAMILIES if hasattr(f, "ARCHITECTURE"))


def family_of_model_type(model_type: Any) -> ModuleType:
    for family in FAMILIES:
        if model_type in family.MODEL_TYPES:
            return family
    raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {list(HF_MODEL_TYPES)}")


def import_keys(hf_config: dict) -> tuple[dict[str, Any], bool]:
    """config.json -> (the family's `model:` keys, tie_word_embeddings' default for it)."""
    hf = HFConfig(hf_config)
    family = family_of_model_type(hf.model_type)
    return family.model_keys(hf), family.TIED_DEFAULT


def family_for(cfg) -> ModuleType | None:
    """The family whose config.json and weight names `cfg` has (what an export writes and an import reads)."""
    return next((f for f in FAMILIES if f.exports(cfg)), None)


def folder_family(architecture: str) -> ModuleType | None:
    """The family folder (runtime/families/<name>) whose network is model.architecture=`architecture`: it builds
    the model and names its weights (its model.py MODEL and weights.py rules); None for gpt and llama, built here."""
    return next((f for f in FAMILIES if getattr(f, "ARCHITECTURE", None) == architecture), None)


def computed_switches(architecture: str, llama: tuple[str, ...]) -> tuple[str, ...]:
    """The ModelConfig switches an architecture computes: the Llama decoder's (`llama`, rules.LLAMA_SWITCHES), a
    folder family's SWITCHES, none for GPT."""
    family = folder_family(architecture)
    return llama if architecture == "llama" else family.SWITCHES if family is not None else ()


def gated_mlp(architecture: str) -> bool:
    """Whether each MLP (or expert) is gated, three matrices of hidden x ffn rather than two (FLOPs, parameters and
    activations count them): the Llama decoder's SwiGLU, and a folder family's when its GATED_MLP says so."""
    family = folder_family(architecture)
    return architecture == "llama" if family is None else family.GATED_MLP


def export_family(cfg) -> ModuleType:
    """The family an export of `cfg` is written as; ValueError names the key when none computes it exactly (a model
    trained with choices its family's transformers class does not make: token dropping, a sigmoid router, ...)."""
    family = family_for(cfg)
    if family is None:  # every combination of ModelConfig's switches has a family today; a new switch may not
        raise ValueError("no Hugging Face family here computes this model; see docs/runtime.md, Adding a model family")
    if problem := family.refusal(cfg):
        raise ValueError(problem)
    return family


__all__ = ["FAMILIES", "FOLDER_ARCHITECTURES", "HF_MODEL_TYPES", "HFConfig", "computed_switches", "export_family", "family_for",
           "family_of_model_type", "folder_family", "gated_mlp", "import_keys"]
