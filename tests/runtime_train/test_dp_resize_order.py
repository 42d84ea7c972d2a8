# Issue 62: a checkpoint saved at dp4 resumes at dp2 and at dp8 with the sample sequence of the uninterrupted run,
# for pretraining, fine-tuning (packed rows) and alignment (preference pairs).
#
# No processes and no model: every rank's train batches are built by build_data (runtime/data/training.py), as the
# trainer builds them, from small files written here. The data state goes through the checkpoint's own code:
# TrainingCheckpoints._extra (what a save writes into every rank file's header), a torch.save / weights_only load
# of it (how the rank file index holds it), and TrainingCheckpoints.resume, with the weights' part of loading
# (load_checkpoint, which needs a model and process groups) replaced by one that hands back the saved header the
# way it chooses it: this rank's when the world size is unchanged, rank 0's otherwise.
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runtime.checkpoint import session
from runtime.checkpoint.manager import Committed
from runtime.checkpoint.session import TrainingCheckpoints
from runtime.config import CheckpointConfig, DataConfig, TrainerConfig
from runtime.data.training import build_data
from runtime.device import Device
from runtime.schema.training_config import AlignmentConfig, SFTDataConfig
from runtime.sft.synthetic import tokenizer_config, train_tokenizer
from tests.alignment.test_preference_data import pairs
from tests.runtime_train.helpers import write_mmidx
from tests.sft.test_sft_data import records, write_jsonl

GLOBAL_BATCH, MICRO, STEPS, SAVED_AT = 8, 1, 7, 3  # the save after step 3 of 7, i.e. at consumed_samples 24
FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "pair_ids")
NO_SAVES = CheckpointConfig(enabled=False, dirpath="unused", every_n_train_steps=0, save_top_k=-1, save_last=False,
                            async_save=False, load_on_one_replica=False, resume_if_exists=True,
                            resume_from_checkpoint=None, save_on_signal=False)


class RankDevice(Device):
    """The trainer's CPU device of one rank; its ranks are built one after the other here (rank 0, the builder of
    every cache, first), so a barrier has no one to wait for."""

    def barrier(self) -> None:
        pass


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    """The three kinds' training configs, as much of them as build_data reads, on small files."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    prefix = write_mmidx(root / "corpus", [rng.integers(0, 500, size=int(n)) for n in rng.integers(5, 40, 60)])
    texts = ["user assistant system", "reverse: red fox the sun", "fox red", "upper: blue owl", "BLUE OWL",
             "What is 2 + 2? 4", "the red fox and the blue owl"] * 20
    tokenizer_json = train_tokenizer(texts, 400)
    (root / "tokenizer.json").write_text(tokenizer_json)
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer_json)))
    chats = write_jsonl(root / "chats.jsonl", records(30))
    preferences = write_jsonl(root / "pairs.jsonl", pairs(20))
    trainer = TrainerConfig(num_nodes=1, devices=1, accelerator="cpu", max_steps=STEPS, log_every_n_steps=1,
                            val_check_interval=0, limit_val_batches=0, gradient_clip_val=0.0)

    def config(kind: str, data_prefix, seq_length: int, **stage) -> SimpleNamespace:
        data = DataConfig(data_prefix=data_prefix, splits_string="1,0,0", seq_length=seq_length,
                          micro_batch_size=MICRO, global_batch_size=GLOBAL_BATCH,
                          index_mapping_dir=str(root / f"cache_{kind}"), num_workers=1)
        fields = dict(data=data, trainer=trainer, seed=1234, tokenizer_path=str(root), sft=None, alignment=None,
                      reward_model=None,
                      model=SimpleNamespace(vocab_size=512), parallel=SimpleNamespace(context_kind="ring"))
        return SimpleNamespace(**{**fields, **stage})

    sft = SFTDataConfig(train_files=(str(chats),), validation_files=(), chat_template=None, packing=True,
                        truncation="right")
    pairs_stage = SFTDataConfig(train_files=(str(preferences),), validation_files=(), chat_template=None,
                                packing=False, truncation="right")
    dpo = AlignmentConfig(strategy="dpo", beta=0.1, loss_type="sigmoid", max_prompt_length=48,
                          truncation_mode="keep_start", precompute_ref_log_probs=True)
    return {"pretraining": config("pretraining", prefix, 12),
            "sft": config("sft", None, 64, sft=sft),
            "dpo": config("dpo", None, 64, sft=pairs_stage, alignment=dpo)}


def topology(rank: int, dp: int) -> SimpleNamespace:
    """What the data and the resume read of a Topology: data-parallel rank and size, no context group."""
    return SimpleNamespace(data_rank=rank, data_size=dp, dp=SimpleNamespace(rank=rank, size=dp),
                           cp=SimpleNamespace(rank=0, size=1))


def build_ranks(cfg, dp: int) -> list[TrainingCheckpoints]:
    """Every rank's train batches at dp, built by build_data, each under the trainer's checkpoint session."""
    sessions = []
    for rank in range(dp):
        device = RankDevice("cpu", torch.device("cpu"), rank=rank, world_size=dp, local_rank=rank, hardware="cpu")
        topo = topology(rank, dp)
        train, valid = build_data(cfg, topo, device)
        assert valid is None
        sessions.append(TrainingCheckpoints(NO_SAVES, device, topo, None, None, train, {}, STEPS))
    return sessions


def run_steps(sessions: list[TrainingCheckpoints], count: int) -> list[dict]:
    """`count` steps: per step the sample ids (positions in the run's sample sequence) every rank read and the
    tensors it trained on, the ranks' micro-batches in rank order, field by field."""
    steps = []
    for _ in range(count):
        ids = [s.batches.rank_sample_indices(s.batches.consumed_samples) for s in sessions]
        micro_batches = [mb for s in sessions for mb in s.batches.next_batch()]
        step = {"ids": torch.from_numpy(np.concatenate(ids))}
        for name in FIELDS:
            if getattr(micro_batches[0], name) is not None:
                step[name] = torch.cat([getattr(mb, name) for mb in micro_batches])
        steps.append(step)
    return steps


def save(sessions: list[TrainingCheckpoints], step: int) -> list[bytes]:
    """Each rank's `extra` as a save writes it into its rank file's header (a torch.save)."""
    out = []
    for s in sessions:
        buffer = io.BytesIO()
        torch.save({"rank": s.device.rank, "extra": s._extra(step)}, buffer)
        out.append(buffer.getvalue())
    return out


def resume(sessions: list[TrainingCheckpoints], headers: list[bytes], monkeypatch) -> None:
    """TrainingCheckpoints.resume on every rank, its loading handing back the header load_checkpoint would."""
    saved = [torch.load(io.BytesIO(h), weights_only=True) for h in headers]
    checkpoint = Committed("step_00000003.0000abcd", SAVED_AT, {"world_size": len(saved), "layout": {"dp": 4}})

    def load_checkpoint(storage, committed, model, optimizer, topo, *, rank, **_):
        same_world = committed.meta["world_size"] == topo.dp.size
        header = saved[rank] if same_world else saved[0]
        return {"extra": header["extra"], "same_world": same_world}

    monkeypatch.setattr(session, "load_checkpoint", load_checkpoint)
    for s in sessions:
        s._find = lambda: (SimpleNamespace(root="memory"), checkpoint)
        assert s.resume() == SAVED_AT


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


_REFERENCE: dict = {}


def reference(cfg, kind: str) -> list[dict]:
    """The uninterrupted one-process run's steps."""
    if kind not in _REFERENCE:
        _REFERENCE[kind] = run_steps(build_ranks(cfg, 1), STEPS)
    return _REFERENCE[kind]


@pytest.mark.parametrize("kind", ["pretraining", "sft", "dpo"])
def test_dp4_checkpoint_resumes_at_dp2_and_dp8_with_the_same_samples(configs, kind, monkeypatch):
    cfg = configs[kind]
    expected = reference(cfg, kind)
    assert all(torch.equal(s["ids"], torch.arange(i * 8, i * 8 + 8)) for i, s in enumerate(expected))
    if kind != "pretraining":  # the run reads the rows in more than one seeded epoch, and resumes inside one
        rows = len(build_ranks(cfg, 1)[0].batches.dataset.dataset)
        assert rows < STEPS * GLOBAL_BATCH and SAVED_AT * GLOBAL_BATCH % rows != 0, rows
    dp4 = build_ranks(cfg, 4)
    before = run_steps(dp4, SAVED_AT)
    assert same(before, expected[:SAVED_AT])
    headers = save(dp4, SAVED_AT)
    assert same(run_steps(dp4, STEPS - SAVED_AT), expected[SAVED_AT:])  # the uninterrupted dp4 run
    for dp in (2, 8):
        resumed = build_ranks(cfg, dp)
        resume(resumed, headers, monkeypatch)
        assert all(s.batches.consumed_samples == SAVED_AT * GLOBAL_BATCH for s in resumed)
        assert same(run_steps(resumed, STEPS - SAVED_AT), expected[SAVED_AT:]), f"{kind} resumed at dp{dp}"


@pytest.mark.parametrize("kind", ["pretraining", "sft", "dpo"])
def test_a_resume_without_the_data_state_reads_other_samples(configs, kind, monkeypatch):
    """The test above cannot pass by accident: starting over at consumed_samples 0 trains on other samples."""
    cfg = configs[kind]
    expected = reference(cfg, kind)
    dp4 = build_ranks(cfg, 4)
    run_steps(dp4, SAVED_AT)
    headers = save(dp4, SAVED_AT)
    forgotten = []
    for header in headers:
        state = torch.load(io.BytesIO(header), weights_only=True)
        state["extra"]["data"] = {"consumed_samples": 0}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        forgotten.append(buffer.getvalue())
    resumed = build_ranks(cfg, 2)
    resume(resumed, forgotten, monkeypatch)
    steps = run_steps(resumed, STEPS - SAVED_AT)
    assert all(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(steps, expected[SAVED_AT:]))
