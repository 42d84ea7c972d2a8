"""The rl stage's part of a training stage config: the `grpo` section (TRL GRPOConfig's keys, with TRL 1.16's
defaults, and ours: reward, reward_model, max_prompt_length), refused in any other stage, and its rules at launch:
the reward imports, the prompt files hold the records it needs, the batch holds whole groups on every data-parallel
rank, and the layout lets each rank generate alone.

model.global_batch_size counts completions (rows through the model, as in every trainer stage), so prompts per step
= global_batch_size / num_generations, and model.micro_batch_size is rows per micro-batch."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from runtime.schema import choices as C
from runtime.schema.model import read_hf_config
from runtime.schema.prompts import load_reward, read_prompts
from runtime.schema.reader import Report, Section
from runtime.schema.records import LAUNCH_SCAN_BYTES
from runtime.schema.training_config import (DataConfig, LoraConfig, ParallelConfig, RLConfig, SFTDataConfig,
                                            TrainerConfig)
from runtime.schema.training_files import Files, is_remote
from runtime.schema.training_model import model_shape

STAGE = "rl"
DEFAULT_REWARD = "runtime.rl.rewards:prefix_match"
ALGORITHMS = C.Choices(("grpo", "ppo"))
KL_ESTIMATORS = C.Choices(("k1", "k3"))  # runtime/rl/ppo.py's
# The grpo section's loss keys (TRL's defaults), which a ppo run must leave alone.
GRPO_LOSS_DEFAULTS = {"beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "delta": None, "loss_type": "dapo",
                      "scale_rewards": "group"}


def read_stage_rl(root: Section, p: str, seq_length: int | None, sft: SFTDataConfig | None, data: DataConfig | None,
                  report: Report) -> tuple[RLConfig | None, SFTDataConfig | None]:
    """The rl stage's grpo section, and its prompt files' config (`sft`, never packed); any other stage with a grpo
    section is refused."""
    stage = p.rstrip(".")
    if stage != STAGE:
        for key in ("grpo", "ppo", "algorithm"):
            if root.has(key):
                report.error(f"{stage}.{key}: GRPO and PPO train in the rl stage; use stages=[rl] rl=<recipe>, or "
                             f"remove {stage}.{key}")
        return None, sft
    algorithm = root.choice("algorithm", ALGORITHMS, "grpo")
    g = root.section("grpo")
    trl = dict(num_generations=g.int("num_generations", 8, minimum=1),
               max_completion_length=g.int("max_completion_length", 512, minimum=1),
               temperature=g.float("temperature", 1.0, minimum=0.0), top_p=g.float("top_p", 1.0, above=0.0),
               beta=g.float("beta", 0.0, minimum=0.0), epsilon=g.float("epsilon", 0.2, minimum=0.0),
               epsilon_high=g.float("epsilon_high", None, minimum=0.0), delta=g.float("delta", None),
               loss_type=g.choice("loss_type", C.GRPO_LOSS_TYPES, "dapo"),
               scale_rewards=g.choice("scale_rewards", C.GRPO_SCALE_REWARDS, "group"),
               mask_truncated_completions=g.bool("mask_truncated_completions", False))
    reward_set = g.raw("reward", None) is not None
    reward = g.str("reward", DEFAULT_REWARD)
    reward_model = g.str("reward_model", None)
    completion = trl["max_completion_length"] or 0
    limit = g.int("max_prompt_length", max((seq_length or 0) - completion, 1), minimum=1)
    g.done()
    problems = _trl_problems(g, trl)
    if reward_model is not None and reward_set:
        problems.append(f"{g.key('reward_model')} and {g.key('reward')} are both set; GRPO scores with one: set "
                        f"{g.key('reward')}=null to score with the reward model, or remove {g.key('reward_model')}")
    if limit is not None and seq_length and trl["max_completion_length"] and limit + completion > seq_length:
        problems.append(f"{g.key('max_prompt_length')}: {limit} + max_completion_length {completion} = "
                        f"{limit + completion} tokens is more than a row, model.encoder_seq_length {seq_length}; "
                        f"lower them or raise encoder_seq_length")
    if reward is not None and reward_model is None:
        try:
            load_reward(reward)
        except ValueError as error:
            problems.append(f"{g.key('reward')}: {str(error).removeprefix('reward: ')}")
    prompts = None
    if data is not None and trl["num_generations"]:
        prompts, rest = divmod(data.global_batch_size, trl["num_generations"])
        if rest:
            problems.append(f"{p}model.global_batch_size: {data.global_batch_size} completions per step are not whole "
                            f"groups of grpo.num_generations {trl['num_generations']}; make it a multiple (prompts "
                            f"per step = global_batch_size / num_generations)")
    ppo = read_ppo(root, algorithm, g, trl, problems)
    for problem in problems:
        report.error(problem)
    if sft is not None:
        sft = dataclasses.replace(sft, packing=False)  # a row is one prompt and one completion
    if problems or _unset(trl) or reward is None or limit is None or not prompts or algorithm is None:
        return None, sft
    return RLConfig(trl=trl, reward=reward, reward_model=reward_model, max_prompt_length=limit,
                    prompts_per_step=prompts, algorithm=algorithm, ppo=ppo), sft


def read_ppo(root: Section, algorithm: str | None, g: Section, trl: dict, problems: list[str]) -> dict | None:
    """The ppo section (TRL PPOConfig's keys, runtime/rl/ppo.py PPOConfig takes it) of a ppo run; in a grpo run it
    is refused, and in a ppo run so are GRPO's own loss settings off their defaults (the grpo section's sampling,
    reward and prompt keys serve both)."""
    if algorithm != "ppo":
        if algorithm == "grpo" and root.has("ppo"):
            problems.append(f"{root.key('ppo')}: PPO's settings in a GRPO run; set {root.key('algorithm')}=ppo, or "
                            f"remove {root.key('ppo')}")
        return None
    for key, default in GRPO_LOSS_DEFAULTS.items():
        if trl.get(key) is not None and trl[key] != default:
            problems.append(f"{g.key(key)}: {trl[key]} is a GRPO loss setting, which a ppo run does not use; remove "
                            f"it or set it to {default} (PPO's settings are in {root.key('ppo')})")
    s = root.section("ppo")
    ppo = dict(kl_coef=s.float("kl_coef", 0.05, minimum=0.0), cliprange=s.float("cliprange", 0.2, minimum=0.0),
               cliprange_value=s.float("cliprange_value", 0.2, minimum=0.0),
               vf_coef=s.float("vf_coef", 0.1, minimum=0.0), gamma=s.float("gamma", 1.0, minimum=0.0),
               lam=s.float("lam", 0.95, minimum=0.0), whiten_rewards=s.bool("whiten_rewards", False),
               kl_estimator=s.choice("kl_estimator", KL_ESTIMATORS, "k1"),
               num_ppo_epochs=s.int("num_ppo_epochs", 1, minimum=1))
    s.done()
    if ppo["num_ppo_epochs"] is not None and ppo["num_ppo_epochs"] > 1:
        problems.append(f"{s.key('num_ppo_epochs')}: {ppo['num_ppo_epochs']} is not supported (one PPO update per "
                        f"rollout); set {s.key('num_ppo_epochs')}=1")
    return None if any(v is None for v in ppo.values()) else ppo


def _unset(trl: dict) -> bool:
    """A None that is no valid value (epsilon_high and delta may be None: TRL's 'same as epsilon' and 'no cap')."""
    return any(v is None for k, v in trl.items() if k not in ("epsilon_high", "delta"))


def _trl_problems(g: Section, trl: dict) -> list[str]:
    """The ranges runtime/rl/grpo.py GRPOConfig checks, named by key."""
    problems = []
    if trl["epsilon"] is not None and trl["epsilon"] >= 1:
        problems.append(f"{g.key('epsilon')}: {trl['epsilon']} must be below 1 (the ratio is clipped to "
                        f"[1 - epsilon, 1 + epsilon_high])")
    upper = trl["epsilon"] if trl["epsilon_high"] is None else trl["epsilon_high"]
    if trl["delta"] is not None and upper is not None and trl["delta"] <= 1 + upper:
        problems.append(f"{g.key('delta')}: {trl['delta']} must be above 1 + epsilon_high ({1 + upper}), or null")
    return problems


def rl_rules(report: Report, p: str, rl: RLConfig, sft: SFTDataConfig | None, trainer: TrainerConfig,
             parallel: ParallelConfig, packing_set: Any, lora: LoraConfig | None, files: Files,
             vocab: int | None = None) -> None:
    """The layout (generation needs whole sequences on each rank), whole prompts per data-parallel rank, the prompt
    files (local ones read here, as the job reads them) and the reward model's recorded config (vocab: the rl
    stage's tokenizer's vocabulary, None where unknown here)."""
    if parallel.context > 1 or parallel.sequence_parallel:
        key = "sequence_parallel" if parallel.context == 1 else "context_parallel_size"
        report.error(f"{p}model.{key}: the rl stage generates token by token, each rank its whole sequences; set "
                     f"context_parallel_size and ulysses_parallel_size to 1 and sequence_parallel to false")
    if packing_set:
        report.error(f"{p}model.data.packing: true in the rl stage: each row is one prompt and one completion; "
                     f"remove model.data.packing or set it to false")
    if lora is not None:
        report.error(f"{p}model.peft: LoRA in the rl stage is not supported yet (the reference would be the base "
                     f"without adapters); set model.peft.peft_scheme=null to train every weight")
    world = trainer.num_nodes * trainer.devices
    model_ranks = parallel.tp * parallel.pp
    if world % model_ranks == 0 and rl.prompts_per_step % (world // model_ranks):
        dp = world // model_ranks
        report.error(f"{p}model.global_batch_size: {rl.prompts_per_step} prompts per step (global_batch_size / "
                     f"num_generations) do not divide among the {dp} data-parallel ranks; make global_batch_size a "
                     f"multiple of num_generations x {dp}")
    if sft is None:
        report.error(f"{p}model.data.train_ds.file_names: missing; list the prompt files (.jsonl with prompt, "
                     f"answer) to train on")
    if rl.reward_model is not None and files.inputs_checked and not is_remote(rl.reward_model):
        if not os.path.exists(rl.reward_model):
            files.problem(f"{p}grpo.reward_model: {rl.reward_model} does not exist; point it at an rlhf_rm run's "
                          f"checkpoints or its Hugging Face export")
        elif problem := reward_model_problem(rl.reward_model, f"{p}grpo.reward_model", vocab):
            report.error(problem)
    if sft is not None and files.inputs_checked:
        # a reward model reads no answer; a reward function may say it reads none
        needs_answer = rl.reward_model is None and getattr(load_reward(rl.reward), "needs_answer", True)
        for key, names in (("train_ds", sft.train_files), ("validation_ds", sft.validation_files)):
            for name in names:
                if is_remote(name) or not os.path.isfile(name) or name.endswith(".parquet") \
                        or os.stat(name).st_size > LAUNCH_SCAN_BYTES:
                    continue  # missing: read_sft_data says so; big or parquet: the job reads it before its first step
                try:
                    read_prompts([name], needs_answer)
                except (OSError, ValueError) as error:
                    report.error(f"{p}model.data.{key}.file_names: {' '.join(str(error).split())}")


def recorded_reward_model(path: str) -> tuple[dict, bool, int | None]:
    """A reward model's recorded config (a Hugging Face export's config.json, or the config.yaml of the newest
    complete checkpoint under a checkpoint directory of ours, or of that checkpoint), whether it has a score head,
    and its vocabulary (None where unknown here). Read without torch: the launch checks it. ValueError, one line."""
    from runtime.schema.rules_storage import checkpoint_config

    directory = Path(path)
    if (directory / "config.json").is_file():
        config = read_hf_config(str(directory))
        head = str((config.get("architectures") or [""])[0]).endswith("ForSequenceClassification") \
            and int(config.get("num_labels", len(config.get("id2label") or {}) or 2)) == 1
        vocab = config.get("vocab_size")
        return config, head, int(vocab) if isinstance(vocab, int) else None
    step = directory if (directory / "COMMIT").is_file() else max(
        (d for d in directory.glob("step_*") if (d / "COMMIT").is_file() and (d / "config.yaml").is_file()),
        key=lambda d: d.name, default=None)  # step_{8 digits}.{token}: the name orders the steps
    if step is None or not (step / "config.yaml").is_file():
        raise ValueError(f"{path} is neither a Hugging Face directory (config.json) nor a complete checkpoint of "
                         f"ours (a step_* directory with COMMIT and config.yaml)")
    training, problem = checkpoint_config((step / "config.yaml").read_bytes(), str(step / "config.yaml"))
    if problem:
        raise ValueError(problem)
    head = isinstance(training.get("reward_model"), dict)  # runtime/convert/reward.py is_reward_model, by config
    return training, head, _recorded_vocab(training.get("model"))


def _recorded_vocab(model_raw: Any) -> int | None:
    """The vocabulary a recorded `model:` section sizes (its tokenizer's, or its config.json's), as the launch
    sizes the rl stage's; None when its files are not here."""
    report = Report()
    try:
        _, vocab, _ = model_shape(Section(dict(model_raw or {}), "model", report), "", report,
                                  Files(report, "error"))
    except (TypeError, ValueError):
        return None
    return None if report.errors else vocab


def reward_model_problem(path: str, key: str, vocab: int | None) -> str | None:
    """One line when the reward model at `path` cannot score the rl stage's completions: no reward model, or one of
    another vocabulary than the rl stage's tokenizer's (`vocab`, None: not compared)."""
    try:
        _, head, theirs = recorded_reward_model(path)
    except (OSError, ValueError, TypeError) as error:  # TypeError: a config.json value of the wrong type
        return f"{key}: {' '.join(str(error).split())}"
    if not head:
        return (f"{key}: {path} is not a reward model (no score head); train one with stages=[rlhf_rm], and point "
                f"{key} at its checkpoints or its Hugging Face export")
    if vocab is not None and theirs is not None and theirs != vocab:
        return (f"{key}: {path} is a reward model of another vocabulary: {theirs} tokens, but the rl stage's "
                f"tokenizer (model.tokenizer.model) has {vocab}; train the reward model with the rl stage's "
                f"tokenizer, or use the tokenizer it was trained with")
    return None
