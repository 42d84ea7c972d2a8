# GRPO's reward from a reward model (grpo.reward_model): an rlhf_rm run's checkpoint directory (or one checkpoint of
# it), or that run's Hugging Face sequence-classification export, scoring each completion the way the rlhf_rm stage
# scored a response (runtime/alignment/reward.py).
#
# The rows. A (prompt, completion) is the chosen side of a preference pair, rendered and cut by the alignment data
# code itself (runtime/schema/preference_pairs.py encode_pairs, rows assembled by runtime/alignment/data.py's
# PreferenceDataset, rebuilt as whole sequences by whole_sequence_rows): the prompt through the chat template with
# its generation header, the completion's text as the assistant's response, ending with the template's end-of-turn
# marker, scored there. The pair's rejected side, an empty response (or "-" for an empty completion, so the two
# differ), is rendered alongside and never scored. The chat template and tokenizer are the rl stage's: the launch
# checks that the reward model's vocabulary is the rl stage's tokenizer's (runtime/schema/training_rl.py). The
# reward model's own row length (its encoder_seq_length) and prompt limit cut a long row as its training cut one
# (keep_start: a prompt is never refused).
#
# The model. Built as the policy is laid out: tensor parallel over the policy's TP group (the score head is whole on
# every rank, so every TP rank gets the same scores), each data-parallel rank scoring its own rows. Under pipeline
# parallelism it is built un-pipelined on every rank (each stage scores its group's rows alone). Its weights: a
# checkpoint of ours read by byte ranges, each rank its own TP rows (runtime/finetune.py load_pretrained with
# score_head, then the head whole), or the export's safetensors read by slices (runtime/convert/hf_slices.py).
# Frozen, eval mode, under no_grad, in micro-batches of the rl stage's micro_batch_size, under the policy's autocast.
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from runtime.alignment.data import PreferenceDataset
from runtime.alignment.reward import RewardObjective, meta_reward_model, whole_sequence_rows
from runtime.micro_batch import PreparedBatch
from runtime.parallel.topology import AxisGroup, Topology
from runtime.rl.rewards import Reward, score
from runtime.schema.chat import ChatTokenizer
from runtime.schema.model import ModelConfig, hf_model_keys, read_hf_config
from runtime.schema.preference_pairs import Limits, encode_pairs
from runtime.schema.records import Message, PreferenceRecord
from runtime.schema.training_rl import recorded_reward_model, reward_model_problem

KEY = "rl.grpo.reward_model"


@dataclasses.dataclass(frozen=True)
class RewardModelSource:
    """Where a reward model's weights are and what its recorded config makes of it."""

    path: str
    hf: bool                    # a Hugging Face export (else a checkpoint directory of ours)
    cfg: ModelConfig            # the decoder's shape (meta_reward_model adds the score head)
    seq_length: int             # its rows' length in training (encoder_seq_length; an export: its positions)
    max_prompt_length: int      # its prompt limit in training, at most seq_length - 1


def reward_model_source(path: str, tokenizer_path: str, vocab: int | None) -> RewardModelSource:
    """The reward model at `path`, checked as the launch checks it (ValueError, one line); its shape from its
    recorded config, sized with the rl stage's tokenizer (`vocab`: that tokenizer's vocabulary)."""
    from runtime.config import parse_model_config

    if problem := reward_model_problem(path, KEY, vocab):
        raise ValueError(problem)
    recorded, _, _ = recorded_reward_model(path)
    if (Path(path) / "config.json").is_file():
        keys = hf_model_keys(read_hf_config(path), vocab)
        cfg = ModelConfig.from_model_section(keys, vocab or int(recorded["vocab_size"]))
        seq = prompt = int(keys["encoder_seq_length"])
        return RewardModelSource(path, True, cfg, seq, prompt - 1)
    model = recorded["model"]
    tokenizer = str((model.get("tokenizer") or {}).get("model") or "")
    cfg = parse_model_config(model, tokenizer if Path(tokenizer).is_file() else tokenizer_path)
    seq = int(model.get("encoder_seq_length") or cfg.max_position_embeddings)
    prompt = int((recorded.get("reward_model") or {}).get("max_prompt_length") or seq)
    return RewardModelSource(path, False, cfg, seq, min(prompt, seq - 1))


def build_reward_model(source: RewardModelSource, topo: Topology, device: torch.device | str | None = None
                       ) -> nn.Module:
    """This rank's part of the reward model (the policy's TP group; un-pipelined), its weights loaded, frozen."""
    from runtime.parallel import parallelize_model

    if topo.pp.size > 1:  # every pipeline stage holds the whole reward model (its TP part)
        topo = dataclasses.replace(topo, pp=AxisGroup(0, 1, (topo.rank,), None), embedding=None)
    model = parallelize_model(meta_reward_model(source.cfg), topo, device=device,
                              starting_weights=lambda model, plan: _load(model, plan, source))
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def _load(model: nn.Module, plan, source: RewardModelSource) -> None:
    """The decoder's weights, each rank its selection, then the score head whole. (runtime.convert is imported
    here, not at the top: the trainer imports this module, and its environment need not have safetensors.)"""
    from runtime.convert.reward import HEAD as HEAD_NAME, HF_HEAD

    if source.hf:
        from safetensors import safe_open

        from runtime.convert.hf_slices import SlicedReader

        reader = SlicedReader(source.path, dataclasses.replace(source.cfg, share_embeddings_and_output_weights=True))
        if not reader.available or HF_HEAD not in reader.files:
            raise ValueError(f"{KEY}: {source.path} is not a reward model's Hugging Face export (safetensors with "
                             f"the decoder's weights and {HF_HEAD}); export the rlhf_rm run with stages=[conversion]")
        for local, param in model.named_parameters():
            full = plan.full_name(local)
            if full != HEAD_NAME:
                param.copy_(reader.read(full, plan.selection(local)))
        with safe_open(str(reader.files[HF_HEAD]), framework="pt", device="cpu") as file:
            head = file.get_tensor(HF_HEAD)
    else:
        from runtime.checkpoint import ranged_full_tensors, resolve_checkpoint
        from runtime.finetune import load_pretrained

        load_pretrained(model, source.path, plan, score_head=True)
        storage, checkpoint = resolve_checkpoint(source.path)
        with ranged_full_tensors(storage, checkpoint) as full:
            head = full.get(HEAD_NAME, "value")
    if tuple(head.shape) != (1, source.cfg.hidden_size):
        raise ValueError(f"{KEY}: {source.path} holds a score head of shape {tuple(head.shape)}, not (1, "
                         f"{source.cfg.hidden_size}): not a reward model of this shape")
    model.output.weight.copy_(head)


class RewardModel:
    """A built reward model and how it renders rows: scores(prompts, completions) -> one float each."""

    def __init__(self, model: nn.Module, source: RewardModelSource, chat: ChatTokenizer, *, micro_batch_size: int,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.source, self.chat = model, source, chat
        self.limits = Limits(source.seq_length, source.max_prompt_length, "keep_start", KEY)
        self.micro_batch_size, self.autocast = micro_batch_size, autocast
        self.objective = RewardObjective()

    def rows(self, prompts: Sequence[list[Message]], completions: Sequence[str]) -> PreparedBatch:
        """Each (prompt, completion) as the rlhf_rm stage reads a response: (N, T) whole sequences, the loss mask
        1 at the scored position (the end-of-turn marker), T cut to the longest row's scored position + 1."""
        records = [PreferenceRecord(f"completion {i}", list(prompt), [_assistant(text)],
                                    [_assistant("-" if text == "" else "")])
                   for i, (prompt, text) in enumerate(zip(prompts, completions, strict=True))]
        pairs = encode_pairs(records, self.limits, self.chat)
        if len(pairs.kept) != len(records):  # max_prompt_length < seq_length leaves every response a token
            raise AssertionError(f"{len(records) - len(pairs.kept)} completions left no row to score")
        arrays = {"tokens": np.array(pairs.tokens, dtype=np.int64), "loss": np.array(pairs.loss, dtype=np.int64),
                  "bounds": np.array(pairs.bounds, dtype=np.int64).reshape(-1, 4)}
        dataset = PreferenceDataset(arrays, self.limits.seq_length, self.chat.pad_id, {}, "", Path("."))
        chosen = torch.from_numpy(np.stack([dataset[i][0] for i in range(len(dataset))]))  # (N, 4, seq_length)
        batch = whole_sequence_rows(PreparedBatch(chosen[:, 0], chosen[:, 1], chosen[:, 2].float()))
        width = int(batch.loss_mask.argmax(dim=1).max()) + 1  # positions after every score: causally unseen
        return PreparedBatch(batch.input_ids[:, :width], batch.labels[:, :width], batch.loss_mask[:, :width])

    @torch.no_grad()
    def scores(self, prompts: Sequence[list[Message]], completions: Sequence[str]) -> list[float]:
        if not completions:
            return []
        rows = self.rows(prompts, completions)
        device = next(self.model.parameters()).device
        out = []
        for i in range(0, rows.input_ids.shape[0], self.micro_batch_size):
            batch = PreparedBatch(*(t[i:i + self.micro_batch_size].to(device) for t in rows[:3]))
            with self.autocast():
                per_position = self.model(batch.input_ids, batch.labels).float()
            out.append(self.objective.rewards(per_position, batch))
        return torch.cat(out).cpu().tolist()

    def reward(self, prompts: Sequence[list[Message]]) -> "ModelReward":
        """This model's reward of completions to `prompts` (a prompt set's messages, by index)."""
        return ModelReward(self, list(prompts))


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


class ModelReward:
    """A reward model bound to a prompt set: (completions, their prompts' indices in the set) -> rewards. It reads
    no answer."""

    needs_answer = False

    def __init__(self, model: RewardModel, prompts: list[list[Message]]):
        self.model, self.prompts = model, prompts

    def __call__(self, completions: Sequence[str], prompt_indices: Sequence[int]) -> list[float]:
        return self.model.scores([self.prompts[i] for i in prompt_indices], completions)


def rewards_of(reward: Reward | ModelReward, completions: Sequence[str], answers: Sequence[str],
               prompt_indices: Sequence[int], name: str | None = None) -> list[float]:
    """The completions' rewards: a reward model's, all rows at once (every TP rank calls it with the same rows),
    or a reward function's, one completion at a time (runtime/rl/rewards.py score)."""
    if isinstance(reward, ModelReward):
        return reward(completions, prompt_indices)
    return score(reward, completions, answers, prompt_indices, name)
