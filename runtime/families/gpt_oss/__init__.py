# GPT-OSS (GptOssForCausalLM, model_type "gpt_oss"), everything that knows it: config.json <-> our `model:` keys
# (config.py, standard library only: the launcher imports this package without torch), the network composed from
# the shared pieces (model.py), Hugging Face's weight names both ways (weights.py). How its weights split under
# TP and EP is the shared pieces' own: q/k/v/o with their biases as any attention, the sinks by query head, the
# experts by expert (EP) and by hidden unit (TP: a run of interleaved gate/up pairs), the router and down_bias
# whole (runtime/parallel/parallelize.py, runtime/parallel/experts.py).
#
# The family protocol of runtime/schema/families (MODEL_TYPES, TIED_DEFAULT, model_keys, exports, refusal,
# hf_config), plus what a folder family adds: ARCHITECTURE (its model.architecture) and the torch-side hooks
# model_class and weight_rules, imported when called.
from __future__ import annotations

from runtime.families.gpt_oss.config import (ARCHITECTURE, MODEL_TYPES, TIED_DEFAULT, exports, hf_config,
                                             model_keys, refusal)


def model_class():
    """The network's class: CausalLM(cfg)."""
    from runtime.families.gpt_oss.model import GptOssModel

    return GptOssModel


def weight_rules(cfg, rule):
    """Our tensors <-> Hugging Face's, as `rule(ours, hf_names)` records (runtime/convert/hf.py's _Rule)."""
    from runtime.families.gpt_oss.weights import weight_rules as rules

    return rules(cfg, rule)


__all__ = ["ARCHITECTURE", "MODEL_TYPES", "TIED_DEFAULT", "exports", "hf_config", "model_class", "model_keys",
           "refusal", "weight_rules"]
