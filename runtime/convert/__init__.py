"""Weight conversion between the runtime's full (unsharded) state dict and other formats.

`hf`: Hugging Face GPT2LMHeadModel / LlamaForCausalLM / MixtralForCausalLM state dicts, config.json and
model directories.
"""
from runtime.convert.hf import from_hf, load_hf_directory, save_hf_directory, to_hf
from runtime.schema.model import hf_model_keys as model_keys

__all__ = ["from_hf", "load_hf_directory", "model_keys", "save_hf_directory", "to_hf"]
