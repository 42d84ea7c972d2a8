# The stages a launch can run, written once (issue 59, "one owner per fact"): their names, the order a launch runs
# them in, and the program each runs on the nodes (python -m PROGRAM). A stage's name is also its config group
# (launcher/paths.py CONFIG_GROUPS) and the key of its section in the launch config. The launcher offers them as
# `stages=[...]` and builds a job for each (launcher/stages.py); the trainer takes its --stage from TRAINER_STAGES.
# Torch-free and import-free, like all of runtime/schema: tab completion reads it.
from __future__ import annotations

TRAINER = "runtime.train"

STAGE_PROGRAMS: dict[str, str] = {
    "data_preparation": "runtime.data_prep",
    "training": TRAINER,
    "fine_tuning": TRAINER,
    "peft": TRAINER,
    "alignment": TRAINER,
    "rlhf_rm": TRAINER,
    "rl": TRAINER,
    "conversion": "runtime.convert",
    "evaluation": "runtime.evaluate",
}

STAGES = tuple(STAGE_PROGRAMS)
# The training stage's program under training.runtime=torchtitan (python -m runtime.titan.train --job MODULE): it
# hands the module the launcher generated (launcher/titan.py) to torchtitan's own Trainer.
TITAN_PROGRAM = "runtime.titan.train"
# Stages that run the trainer (runtime.train): one config schema (runtime/schema/training.py), one kind of job
# (the same job shape, checkpoints, preemption and metrics).
# fine_tuning is full-parameter SFT, peft is LoRA, alignment is DPO or ORPO on preference pairs (full-parameter or
# LoRA), rlhf_rm a reward model on the same pairs (NeMo-Launcher's name), rl GRPO on prompts with a reward
# function; the trainer is told which with --stage, which names their keys.
TRAINER_STAGES = tuple(stage for stage, program in STAGE_PROGRAMS.items() if program == TRAINER)
# The trainer stages that start from model.restore_from_path and read record files (model.data.train_ds).
FINE_TUNING_STAGES = tuple(stage for stage in TRAINER_STAGES if stage != "training")
# The trainer stages whose records are preference pairs (prompt, chosen, rejected), read alike.
PAIR_STAGES = ("alignment", "rlhf_rm")
