"""Weight conversion between the runtime's full (unsharded) state dict and other formats.

`hf`: Hugging Face GPT2LMHeadModel / LlamaForCausalLM state dicts, config.json and model directories.
"""
from runtime.convert.hf import from_hf, load_hf_directory, model_keys, save_hf_directory, to_hf

__all__ = ["from_hf", "load_hf_directory", "model_keys", "save_hf_directory", "to_hf"]
