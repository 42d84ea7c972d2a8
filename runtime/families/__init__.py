# The registry of model families that live in one folder each (docs/runtime.md, "Adding a model family"):
# runtime/families/<name>/ holds everything that knows the family, and <name> is its `model.architecture`.
#   __init__.py  standard library only (the launcher imports it without torch): the config.json <-> `model:` keys
#                protocol of runtime/schema/families (MODEL_TYPES, TIED_DEFAULT, model_keys, exports, refusal,
#                hf_config), and ARCHITECTURE (runtime/schema/architecture.py: what shared code asks of it)
#   model.py     MODEL, the network: a CausalLM composed from runtime/models/layers.py
#   weights.py   rules(cfg, Rule): our tensors <-> Hugging Face tensors, both ways (runtime/convert/hf.py)
# The shared layers find a family by name (runtime/schema/folder_families.py), never by `architecture == "<name>"`,
# and import none: a family depends on them, not the reverse. Adding a family is its folder and its name here.
FOLDERS: tuple[str, ...] = ("gemma3", "gpt_oss", "deepseek_v3")
