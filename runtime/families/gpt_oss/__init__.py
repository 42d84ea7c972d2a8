# GPT-OSS (GptOssForCausalLM, model_type "gpt_oss"), everything that knows it: config.json <-> our `model:` keys
# (config.py, standard library only: the launcher imports this package without torch), the network composed from
# the shared pieces (model.py), Hugging Face's weight names both ways (weights.py). How its weights split under
# TP and EP is the shared pieces' own: q/k/v/o with their biases as any attention, the sinks by query head, the
# experts by expert (EP) and by hidden unit (TP: a run of interleaved gate/up pairs), the router and down_bias
# whole (runtime/parallel/parallelize.py, runtime/parallel/experts.py).
#
# This package is the family protocol of runtime/schema/families (MODEL_TYPES, TIED_DEFAULT, model_keys, exports,
# refusal, hf_config) plus ARCHITECTURE, its registry entry (runtime/schema/architecture.py), all torch-free: the
# launcher imports it. The entry names the torch side: model.py's MODEL (the network) and weights.py's weight_rules
# (runtime/models/__init__.py, runtime/convert/hf.py).
from __future__ import annotations

from runtime.families.gpt_oss.config import (ARCHITECTURE, MODEL_TYPES, TIED_DEFAULT, exports, hf_config,
                                             model_keys, refusal)

__all__ = ["ARCHITECTURE", "MODEL_TYPES", "TIED_DEFAULT", "exports", "hf_config", "model_keys", "refusal"]
