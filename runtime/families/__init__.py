# The registry of the model families, each in one folder (docs/runtime.md, "Adding a model family"):
# runtime/families/<name>/ holds everything that knows the family, and <name> is its `model.architecture`.
#   __init__.py  standard library only (the launcher imports it without torch): the config.json <-> `model:` keys
#                protocol of runtime/schema/families (MODEL_TYPES, TIED_DEFAULT, model_keys, exports, refusal,
#                hf_config), ARCHITECTURE (runtime/schema/architecture.py: what shared code asks of it), and
#                VARIANTS where the same network is several Hugging Face families (a module each, same protocol)
#   model.py     MODEL, the network: a CausalLM composed from runtime/models/layers.py
#   weights.py   weight_rules(cfg, Rule, family): our tensors <-> Hugging Face tensors, both ways
#                (runtime/convert/hf.py)
# The shared layers find a family by name (runtime/schema/folder_families.py), never by `architecture == "<name>"`,
# and import none: a family depends on them, not the reverse. Adding a family is its folder and its name in both
# lists here (tests/schema/test_family_folders.py checks that they hold the same names).
# In the order the schema lists the model.architecture choices (a NeMo file's name is matched in this order too).
FOLDERS: tuple[str, ...] = ("gpt", "llama", "gemma3", "gpt_oss", "deepseek_v3")
# The order the registry tries their Hugging Face families in for an export, each folder's VARIANTS before its own
# (runtime/schema/families FAMILIES). No two families export the same model (each exports() holds for its own
# architecture and switches), so this only orders the supported model_types an import's refusal lists.
EXPORT_ORDER: tuple[str, ...] = ("gemma3", "gpt_oss", "deepseek_v3", "gpt", "llama")
