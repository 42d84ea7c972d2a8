"""The rlhf_rm stage's part of a training stage config: the `reward_model` section (TRL RewardTrainer's
center_rewards_coefficient, and how a long prompt is cut), refused in any other stage, and its rule on the layout.
Its preference files are read and checked as the alignment stage's (training_alignment.preference_file_rules)."""
from __future__ import annotations

import dataclasses
from typing import Any

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.reader import Report, Section
from runtime.schema.training_config import RewardModelConfig, SFTDataConfig

STAGE = "rlhf_rm"


def read_stage_reward(root: Section, p: str, seq_length: int | None, sft: SFTDataConfig | None,
                      report: Report) -> tuple[RewardModelConfig | None, SFTDataConfig | None]:
    """The rlhf_rm stage's reward_model section (absent: TRL's defaults), and its preference files' config (`sft`)
    as it reads them; any other stage with a reward_model section is refused."""
    stage = p.rstrip(".")
    if stage != STAGE:
        report.error(rules.reward_stage(stage, root.has("reward_model")))
        return None, sft
    section = root.section("reward_model")
    center = section.float("center_rewards_coefficient", None, minimum=0.0)
    limit = section.int("max_prompt_length", (seq_length or 2) // 2)
    mode = section.choice("truncation_mode", C.PROMPT_TRUNCATIONS, "keep_start")
    section.done()
    if limit is not None:
        report.error(rules.prompt_limit(limit, seq_length, section.key("max_prompt_length")))
    if sft is not None:
        sft = dataclasses.replace(sft, packing=False)  # pairs are never packed (reward_layout names the key)
    if limit is None or mode is None or (section.data.get("center_rewards_coefficient") is not None and center is None):
        return None, sft
    return RewardModelConfig(center_rewards_coefficient=center, max_prompt_length=limit, truncation_mode=mode), sft


def reward_rules(report: Report, p: str, sft: SFTDataConfig | None, context: int, packing_set: Any) -> None:
    """The layout (context parallelism, packing) and the preference files named."""
    report.error(rules.reward_layout(context, packing_set, p))
    if sft is None:
        report.error(f"{p}model.data.train_ds.file_names: missing; list the preference files (.jsonl with "
                     f"prompt, chosen, rejected) to train the reward model on")
