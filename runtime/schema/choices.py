# Every closed list of names the stage configs accept, in one place. The launcher, the runtime and the docs read
# these; nothing else spells them out. Aliases are other tools' names for exactly the same thing (NeMo's,
# NxD Training's): they are read as the canonical name. A name that means something else is refused at launch.
from __future__ import annotations

from runtime.schema.families import ARCHITECTURES as _ARCHITECTURES
from runtime.schema.reader import Choices

ARCHITECTURES = Choices(tuple(_ARCHITECTURES))  # runtime/schema/families, the registry
# model.rope_scaling.rope_type (Hugging Face's rope_type): the RoPE scalings our rotary tables compute exactly as
# transformers does. Others (longrope, dynamic NTK: tables that change with the sequence length) are refused at
# launch.
ROPE_SCALING_TYPES = Choices(("llama3", "linear", "yarn"))
ACCELERATORS = Choices(("cpu", "gpu", "neuron"))
# training.runtime: what trains a training stage. nxdt is this project's runtime (runtime.train: torch-xla on
# Trainium, torch on CPU and GPU); torchtitan is torchtitan 0.3's Trainer on a module generated from the same keys
# (launcher/titan.py maps them; docs/torchtitan.md says when to use which).
RUNTIMES = Choices(("nxdt", "torchtitan"))
# NxD Training's precision.type names; 'manual' (each flag set by hand) has no counterpart here.
PRECISION_TYPES = Choices(("fp32", "bf16SR", "mixed_precision", "mixed_precisionSR", "autocast"))
# model.optim.name: runtime/parallel/optimizers.py steps each with its library (torch's Adam/AdamW/SGD/Adafactor,
# schedulefree's). Optimizer state is fp32 in every precision here (runtime/precision.py), which is what NxD
# Training's adamw_fp32OptState asks for; NeMo's fused_adam and distributed_fused_adam are AdamW (adam_w_mode
# defaults to true; distributed_fused_adam, AdamW with ZeRO-1, is read by launcher/nemo_config.py), and NeMo's
# plain "adam" is torch.optim.Adam (L2 weight decay), so it stays adam.
OPTIMIZERS = Choices(("adamw", "adam", "sgd", "adafactor", "adamw_schedulefree", "sgd_schedulefree"),
                     {"adamw_fp32OptState": "adamw", "fused_adam": "adamw", "schedule_free_adamw": "adamw_schedulefree", "schedule_free_sgd": "sgd_schedulefree"})
# NeMo's WarmupAnnealing and NxD Training's LinearAnnealingWithWarmUp are the linear decay with warmup.
SCHEDULES = Choices(("CosineAnnealing", "LinearAnnealing", "Constant"),
                    {"WarmupAnnealing": "LinearAnnealing", "LinearAnnealingWithWarmUp": "LinearAnnealing"})
TOKENIZER_LIBRARIES = Choices(("huggingface",))
CHECKPOINT_GRANULARITIES = Choices((None, "full", "selective"))
# NxD Training names the modules by class: CoreAttention, and LlamaMLP / GPT's MLP.
RECOMPUTE_MODULES = Choices(("core_attention", "mlp"), {"CoreAttention": "core_attention", "LlamaMLP": "mlp",
                                                        "MLP": "mlp"})
DEPENDENCIES = Choices(("afterok", "afterany", "singleton"))
# A stage without run.dependency runs only after the one before it succeeded (never training on failed data prep).
DEFAULT_DEPENDENCY = "afterok"
CONVERSION_MODES = Choices(("export", "import"))
# cluster.s3.checksums, botocore's names: CRC checksums on every request that can carry one, or only where S3
# demands one (S3-compatible stores that reject the others).
S3_CHECKSUMS = Choices(("when_supported", "when_required"))

# Fine-tuning (the fine_tuning and peft stages). NeMo's peft.peft_scheme; "none" is full-parameter SFT.
PEFT_SCHEMES = Choices((None, "lora"), {"none": None})
# model.data.train_ds / validation_ds file_names: the record files fine-tuning reads (records.py).
SFT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
# model.data.truncation: what happens to an example longer than seq_length + 1 tokens.
TRUNCATIONS = Choices(("right", "left", "drop"))
# model.data.chat_template: a built-in by name; null reads the tokenizer's tokenizer_config.json.
CHAT_TEMPLATES = ("chatml", "llama3", "plain")
# model.peft.target_modules: Hugging Face / PEFT / NxD Training projection names, and the groups NeMo and NxD
# Training name (qkv_proj is NxD Training's fused QKV; attention_qkv etc. NeMo's).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "attention_qkv": ("q_proj", "k_proj", "v_proj"),
               "attention_dense": ("o_proj",), "mlp_fc1": ("gate_proj", "up_proj"), "mlp_fc2": ("down_proj",),
               "all_linear": LORA_MODULES}
# Multi-head latent attention (model.latent_attention) has no k_proj / v_proj: its projections by Hugging Face's
# names are these (q_proj without q_lora_rank, q_a_proj and q_b_proj with it). A group's q_proj stands for its
# query projections and k_proj / v_proj for the key-value ones (LATENT_LORA_PARTS).
LATENT_LORA_MODULES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LATENT_LORA_PARTS = {"q_proj": ("q_proj", "q_a_proj", "q_b_proj"), "k_proj": ("kv_a_proj_with_mqa", "kv_b_proj"),
                     "v_proj": ("kv_a_proj_with_mqa", "kv_b_proj")}

# Preference alignment (the alignment stage): model_alignment_strategy.<strategy> (NxD Training's keys).
ALIGNMENT_STRATEGIES = Choices(("dpo", "orpo"))
DPO_LOSS_TYPES = Choices(("sigmoid", "ipo"))
# truncation_mode: keep_start cuts a prompt over the limit to its first tokens; keep_end never cuts the prompt's
# end (next to the response), so a prompt over the limit is refused by name (preference_pairs.py).
PROMPT_TRUNCATIONS = Choices(("keep_start", "keep_end"))
# GRPO (the rl stage's grpo section, runtime/rl/grpo.py): TRL's loss normalizations and reward scalings.
GRPO_LOSS_TYPES = Choices(("grpo", "bnpo", "dr_grpo", "dapo"))
GRPO_SCALE_REWARDS = Choices(("group", "batch", "none"))

# The evaluation stage's task types; a bare name is a built-in loss task over a split of the training data, or an
# lm-eval task, group or tag (type lm_eval).
TASK_TYPES = Choices(("loss", "last_word", "multiple_choice", "perplexity", "synthetic_demo", "exact_match"))

# The data_preparation stage.
DATA_SOURCES = Choices(("demo", "files", "urls", "synthetic_instructions", "synthetic_preferences",
                        "synthetic_prompts"))
TOKENIZER_FORMATS = Choices(("huggingface", "sentencepiece"))   # data_preparation.tokenizer.library
BAD_LINE_POLICIES = Choices(("skip", "fail"))
TOKEN_DTYPES = Choices(("auto", "uint16", "int32", "int64"))
TOKENIZER_ENGINES = Choices(("auto", "huggingface", "tiktoken"))
# tokenizer.train.model_type, in both libraries: what converts to the tokenizer.json training reads
TRAINABLE_TOKENIZERS = ("bpe", "unigram")
