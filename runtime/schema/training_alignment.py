"""The alignment stage's part of a training stage config: strategy and model_alignment_strategy (DPO, ORPO),
refused in any other stage, and its rules on the layout, the reference model and the preference files."""
from __future__ import annotations

import dataclasses
from typing import Any

from runtime.schema import choices as C
from runtime.schema import preference_pairs, rules
from runtime.schema.reader import REQUIRED, Report, Section
from runtime.schema.training_config import AlignmentConfig, RewardModelConfig, SFTDataConfig
from runtime.schema.training_files import Files, is_remote


def read_stage_alignment(root: Section, p: str, seq_length: int | None, sft: SFTDataConfig | None,
                         report: Report) -> tuple[AlignmentConfig | None, SFTDataConfig | None]:
    """The alignment stage's section, and its preference files' config (`sft`) as it reads them; any other stage
    with a model_alignment_strategy is refused."""
    stage = p.rstrip(".")
    if stage != "alignment":
        strategies = root.section("model_alignment_strategy")
        report.error(rules.alignment_stage(stage, tuple(k for k in ("dpo", "orpo") if strategies.has(k))))
        return None, sft
    alignment = read_alignment(root, p, seq_length, report)
    if sft is not None:
        sft = dataclasses.replace(sft, packing=False)  # pairs are never packed (alignment_layout names the key)
    return alignment, sft


def read_alignment(root: Section, p: str, seq_length: int | None, report: Report) -> AlignmentConfig | None:
    """strategy and model_alignment_strategy.<strategy> (NxD Training's section; the strategy is also read from
    which subsection is there, as NxD Training does)."""
    strategies = root.section("model_alignment_strategy")
    present = tuple(k for k in C.ALIGNMENT_STRATEGIES if strategies.raw(k, None) is not None)
    strategy = root.choice("strategy", C.ALIGNMENT_STRATEGIES, present[0] if len(present) == 1 else REQUIRED)
    strategies.done()
    if strategy is None:
        return None
    for other in present:
        if other != strategy:
            report.error(f"{strategies.key(other)}: set while {root.key('strategy')} is {strategy}; remove it or set "
                         f"{root.key('strategy')}={other}")
    s = strategies.section(strategy)
    if strategy == "dpo":
        beta_key, limit_key = "kl_beta", "max_dpo_prompt_length"
        loss_type = s.choice("loss_type", C.DPO_LOSS_TYPES, "sigmoid")
        precompute = s.bool("precompute_ref_log_probs", True)
    else:
        beta_key, limit_key, loss_type, precompute = "beta", "max_prompt_length", "orpo", False
    beta = s.float(beta_key, 0.1)
    limit = s.int(limit_key, (seq_length or 2) // 2)
    mode = s.choice("truncation_mode", C.PROMPT_TRUNCATIONS, "keep_start")
    s.done()
    if beta is not None:
        report.error(rules.preference_beta(beta, s.key(beta_key)))
    if limit is not None:
        report.error(rules.prompt_limit(limit, seq_length, s.key(limit_key)))
    if None in (beta, limit, mode, loss_type, precompute):
        return None
    return AlignmentConfig(strategy=strategy, beta=beta, loss_type=loss_type, max_prompt_length=limit,
                           truncation_mode=mode, precompute_ref_log_probs=precompute)


def alignment_rules(report: Report, p: str, alignment: AlignmentConfig, sft: SFTDataConfig | None, context: int,
                    packing_set: Any, lora: bool) -> None:
    """The layout (context parallelism, packing), the preference files named, and DPO's reference model."""
    report.error(rules.alignment_layout(context, packing_set, p))
    if sft is None:
        report.error(f"{p}model.data.train_ds.file_names: missing; list the preference files (.jsonl with "
                     f"prompt, chosen, rejected) to align on")
    if alignment.strategy == "dpo":
        report.error(rules.reference_source(alignment.precompute_ref_log_probs, lora, p))


def preference_file_rules(report: Report, p: str, alignment: AlignmentConfig | RewardModelConfig,
                          sft: SFTDataConfig | None, files: Files, tokenizer_path: str, shape: dict) -> None:
    """Each preference file, tokenized as the stage will (when the files and the tokenizer are looked at here);
    the alignment and the rlhf_rm stages read them alike."""
    if sft is not None and files.inputs_checked and tokenizer_path and not is_remote(tokenizer_path) \
            and "encoder_seq_length" in shape:
        for name in sft.train_files + sft.validation_files:
            report.error(preference_pairs.launch_problem(name, tokenizer_path, sft.chat_template,
                                                         shape["encoder_seq_length"], alignment.max_prompt_length,
                                                         alignment.truncation_mode, p + alignment.limit_key))
