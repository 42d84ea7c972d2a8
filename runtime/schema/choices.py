# Every closed list of names the stage configs accept, in one place. The launcher, the runtime and the docs read
# these; nothing else spells them out. Aliases are other tools' names for exactly the same thing (NeMo's,
# NxD Training's): they are read as the canonical name. A name that means something else is refused at launch.
from __future__ import annotations

from runtime.schema.reader import Choices

ARCHITECTURES = Choices(("gpt", "llama"))
ACCELERATORS = Choices(("cpu", "gpu", "neuron"))
# NxD Training's precision.type names; 'manual' (each flag set by hand) has no counterpart here.
PRECISION_TYPES = Choices(("fp32", "bf16SR", "mixed_precision", "mixed_precisionSR", "autocast"))
# Adam moments are fp32 in every precision here (runtime/precision.py), which is what NxD Training's
# adamw_fp32OptState asks for; NeMo's fused_adam is AdamW (adam_w_mode defaults to true).
OPTIMIZERS = Choices(("adamw",), {"adamw_fp32OptState": "adamw", "fused_adam": "adamw"})
# NeMo's WarmupAnnealing and NxD Training's LinearAnnealingWithWarmUp are the linear decay with warmup.
SCHEDULES = Choices(("CosineAnnealing", "LinearAnnealing", "Constant"),
                    {"WarmupAnnealing": "LinearAnnealing", "LinearAnnealingWithWarmUp": "LinearAnnealing"})
TOKENIZER_LIBRARIES = Choices(("huggingface",))
CHECKPOINT_GRANULARITIES = Choices((None, "full", "selective"))
# NxD Training names the modules by class: CoreAttention, and LlamaMLP / GPT's MLP.
RECOMPUTE_MODULES = Choices(("core_attention", "mlp"), {"CoreAttention": "core_attention", "LlamaMLP": "mlp",
                                                        "MLP": "mlp"})
DEPENDENCIES = Choices(("afterok", "afterany", "singleton"))
CONVERSION_MODES = Choices(("export", "import"))
# cluster.s3.checksums, botocore's names: CRC checksums on every request that can carry one, or only where S3
# demands one (S3-compatible stores that reject the others).
S3_CHECKSUMS = Choices(("when_supported", "when_required"))

# The evaluation stage's task types; a bare name is a built-in loss task over a split of the training data.
TASK_TYPES = Choices(("loss", "last_word", "multiple_choice", "synthetic_demo"))

# The data_preparation stage.
DATA_SOURCES = Choices(("demo", "files", "urls"))
TOKENIZER_FORMATS = Choices(("huggingface", "sentencepiece"))   # data_preparation.tokenizer.library
BAD_LINE_POLICIES = Choices(("skip", "fail"))
TOKEN_DTYPES = Choices(("auto", "uint16", "int32", "int64"))
TOKENIZER_ENGINES = Choices(("auto", "huggingface", "tiktoken"))
# tokenizer.train.model_type, in both libraries: what converts to the tokenizer.json training reads
TRAINABLE_TOKENIZERS = ("bpe", "unigram")
