"""The reward model (runtime/alignment/reward.py, runtime/convert/reward.py) on tiny fp32 models on CPU:

- the Bradley-Terry loss by hand (margin, centering), and the rows rebuilt as whole sequences;
- the first step's loss equals TRL's formula computed on transformers' LlamaForSequenceClassification (and
  GPT2ForSequenceClassification) loaded from our export, whose scores on padded rows equal ours;
- tp2 (with and without sequence parallelism), pp2 and dp2 train as one process: losses, metrics and parameters
  after 2 steps, on real gloo ranks forked from the test;
- a few seconds of training on synthetic pairs (chosen: a fixed pattern, rejected: noise) scores held-out pairs
  far above chance.
"""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from runtime.alignment.reward import (RewardObjective, build_reward_model, scored_positions, whole_sequence_rows)
from runtime.convert.reward import save_reward_hf_directory
from runtime.micro_batch import MicroBatch, PreparedBatch
from runtime.parallel import (DataParallelConfig, ParallelDims, ShardedAdamW, Topology, gather_full_state_dict,
                              parallelize_model)
from runtime.step import eval_objective, train_step
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

SEQ = H.SEQ          # 16 positions a row
PAIRS = 8            # a global batch
MICRO = 2            # pairs a micro-batch
PAD = 127            # the padding id: no example token takes it
CENTER = 0.01        # TRL's center_rewards_coefficient, on in the layout runs so its gradient is compared too
STEPS = 2
LLAMA = dict(num_layers=2)


def examples(step: int, vocab: int = PAD) -> list[tuple[list[int], list[int]]]:
    """2 * PAIRS examples (chosen of every pair, then rejected): (tokens, response flags). Prompts of 3-5
    tokens, responses of 2-12; the last pair's chosen fills the row to the end (17 tokens, 16 positions), so its
    response's last token is cut (the row is scored at its last position)."""
    gen = torch.Generator().manual_seed(77 + step)
    out = []
    for side in range(2):
        for pair in range(PAIRS):
            prompt = 3 + pair % 3
            response = SEQ + 1 - prompt if (side, pair) == (0, PAIRS - 1) else 2 + (pair * 5 + side * 3) % 11
            tokens = torch.randint(0, vocab, (prompt + response,), generator=gen).tolist()
            out.append((tokens, [0] * prompt + [1] * response))
    return out


def alignment_rows(chosen_and_rejected: list[tuple[list[int], list[int]]]):
    """The rows runtime/alignment/data.py makes: input_ids t[:-1] then PAD, labels t[1:] then 0, mask m[1:]."""
    rows = len(chosen_and_rejected)
    ids, labels = torch.full((rows, SEQ), PAD), torch.zeros(rows, SEQ, dtype=torch.int64)
    mask = torch.zeros(rows, SEQ)
    for row, (tokens, flags) in enumerate(chosen_and_rejected):
        width = len(tokens) - 1
        ids[row, :width] = torch.tensor(tokens[:-1])
        labels[row, :width] = torch.tensor(tokens[1:])
        mask[row, :width] = torch.tensor(flags[1:], dtype=torch.float32)
    return ids, labels, mask


def micro_batches(step: int, topo: Topology) -> list[MicroBatch]:
    """This DP rank's pairs of the step, MICRO pairs a micro-batch, chosen rows first (as the alignment loader)."""
    ids, labels, mask = alignment_rows(examples(step))
    per_rank = PAIRS // topo.data_size
    first = topo.data_rank * per_rank
    out = []
    for start in range(first, first + per_rank, MICRO):
        rows = list(range(start, start + MICRO)) + list(range(PAIRS + start, PAIRS + start + MICRO))
        out.append(MicroBatch(ids[rows], labels[rows], mask[rows], None, torch.arange(start, start + MICRO)))
    return out


def hf_rows(step: int) -> torch.Tensor:
    """The same examples as transformers scores them: each one's tokens (the first SEQ), right-padded with PAD."""
    out = torch.full((2 * PAIRS, SEQ), PAD)
    for row, (tokens, _) in enumerate(examples(step)):
        kept = tokens[:SEQ]
        out[row, :len(kept)] = torch.tensor(kept)
    return out


def trl_loss(chosen: torch.Tensor, rejected: torch.Tensor, center: float | None, margin=None) -> float:
    """TRL 1.16 RewardTrainer.compute_loss, spelled out in float64."""
    chosen, rejected = chosen.double(), rejected.double()
    difference = chosen - rejected - (0.0 if margin is None else margin.double())
    loss = -F.logsigmoid(difference).mean()
    if center is not None:
        loss = loss + center * torch.mean((chosen + rejected) ** 2)
    return loss.item()


# ---- the objective by hand ----

def test_loss_and_metrics_by_hand():
    scores = torch.tensor([[0.0, 1.5, 9.0], [0.0, 7.0, -0.5], [0.0, 0.5, 9.0], [2.0, 9.0, 9.0]],
                          requires_grad=True)
    mask = torch.tensor([[0, 1, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]], dtype=torch.float32)  # scored positions
    batch = PreparedBatch(torch.zeros(4, 3), None, mask, pair_ids=torch.tensor([0, 1]))
    margins = torch.tensor([0.25, -1.0])
    objective = RewardObjective(center_rewards_coefficient=0.1, margins=lambda ids: margins[ids])
    totals = objective.totals([batch]).tolist()
    loss, stats = objective(scores, batch, totals)
    chosen, rejected = [1.5, -0.5], [0.5, 2.0]
    expected = sum(-math.log(1 / (1 + math.exp(-(c - r - g)))) + 0.1 * (c + r) ** 2
                   for c, r, g in zip(chosen, rejected, margins.tolist())) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(trl_loss(torch.tensor(chosen), torch.tensor(rejected), 0.1, margins), rel=1e-6)
    reported, metrics = objective.report(stats.tolist(), totals)
    assert reported == pytest.approx(expected, rel=1e-6)
    assert metrics == pytest.approx({"reward_accuracy": 0.5, "reward_margin": (1.0 - 2.5) / 2,
                                     "chosen_reward": 0.5, "rejected_reward": 1.25})
    loss.backward()
    assert torch.all(scores.grad[mask == 0] == 0), "only the scored positions count"


def test_rows_become_whole_sequences_scored_at_the_response_end():
    ids, labels, mask = alignment_rows([([5, 6, 7, 8], [0, 0, 1, 1]), (list(range(SEQ + 1)), [0] * 3 + [1] * 14)])
    batch = whole_sequence_rows(MicroBatch(ids, labels, mask).prepare())
    assert batch.input_ids[0, :4].tolist() == [5, 6, 7, 8]  # the response's last token, 8, is in the row
    assert batch.input_ids[1].tolist() == list(range(SEQ))  # a full row keeps its first SEQ tokens
    assert scored_positions(mask).tolist() == [3, SEQ - 1]
    assert batch.loss_mask.sum(1).tolist() == [1.0, 1.0] and batch.loss_mask[0, 3] == 1


# ---- against transformers: the export, its scores, the first step's loss ----

def single_process(cfg, steps: int, center: float | None = CENTER) -> dict:
    topo = H.make_topology(H.Layout())
    model = parallelize_model(build_reward_model(cfg), topo,
                              data_parallel=DataParallelConfig("fp32", False, bucket_numel=H.BUCKET_NUMEL))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {**train(model, topo, steps, center), "initial": initial}


def train(model, topo: Topology, steps: int, center: float | None, schedule=None) -> dict:
    optimizer = ShardedAdamW(model, H.OPTIM)
    objective = RewardObjective(center)
    losses, metrics = [], []
    for step in range(steps):
        result = train_step(model, optimizer, micro_batches(step, topo), topo, lr=H.OPTIM["lr"], clip=1.0,
                            objective=objective, schedule=schedule)
        losses.append(result.loss)
        metrics.append(result.metrics)
    eval_loss, eval_metrics = eval_objective(model, micro_batches(steps, topo), topo, objective=objective)
    state = {k: v.float() for k, v in gather_full_state_dict(model, topo).items()}
    return {"losses": losses, "metrics": metrics, "eval_loss": eval_loss, "eval_metrics": eval_metrics,
            "state": state}


@functools.cache
def single_process_run(arch: str) -> dict:
    torch.set_num_threads(1)
    return single_process(H.tiny_config(arch, **LLAMA), STEPS)


@pytest.fixture(scope="module")
def reference():
    return single_process_run("llama")


@pytest.mark.parametrize("arch, hf_class", [("llama", "LlamaForSequenceClassification"),
                                             ("gpt", "GPT2ForSequenceClassification")])
def test_export_loads_in_transformers_and_scores_as_ours(arch, hf_class, tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = single_process_run(arch)
    cfg = H.tiny_config(arch, **LLAMA)
    out = save_reward_hf_directory(tmp_path / "rm", reference["initial"], cfg, pad_token_id=PAD)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_class]
    assert (config["num_labels"], config["pad_token_id"]) == (1, PAD)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "score.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    assert torch.equal(hf.score.weight, reference["initial"]["output.weight"])
    rows = hf_rows(0)
    with torch.no_grad():
        theirs = hf(input_ids=rows).logits.squeeze(-1)  # (2 * PAIRS,): each row at its last non-pad token
        model = build_reward_model(cfg).eval()
        ours = model(rows, torch.zeros_like(rows))  # (rows, SEQ) per-position scores
    last = (rows != PAD).sum(1) - 1
    torch.testing.assert_close(ours[torch.arange(len(rows)), last], theirs, rtol=1e-5, atol=1e-5)
    # The first step's loss: TRL's formula on transformers' scores.
    expected = trl_loss(theirs[:PAIRS], theirs[PAIRS:], CENTER)
    assert reference["losses"][0] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert reference["metrics"][0]["reward_accuracy"] == (theirs[:PAIRS] > theirs[PAIRS:]).float().mean().item()
    # A body in several safetensors files: the head joins their index.
    sharded = save_reward_hf_directory(tmp_path / "sharded", reference["initial"], cfg, pad_token_id=PAD,
                                       max_shard_bytes=20_000)
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    again = transformers.AutoModelForSequenceClassification.from_pretrained(sharded, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=rows).logits.squeeze(-1), theirs)


# ---- layouts ----

JOBS = {  # name -> (family, tp, pp, dp, sequence_parallel), each on 2 ranks
    "tp2": ("llama", 2, 1, 1, False),
    "tp2-sp": ("llama", 2, 1, 1, True),
    "pp2": ("llama", 1, 2, 1, False),
    "dp2": ("llama", 1, 1, 2, False),
    # GPT: its LM head tied to the embedding, which the reward model's score head is not; biases, learned positions.
    "gpt-tp2-sp": ("gpt", 2, 1, 1, True),
    "gpt-pp2": ("gpt", 1, 2, 1, False),
}


def run_layouts(jobs: dict) -> dict:
    out = {}
    for name, (arch, tp, pp, dp, sp) in jobs.items():
        topo = Topology.build(ParallelDims(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp))
        cfg = H.tiny_config(arch, **LLAMA)
        model = parallelize_model(build_reward_model(cfg), topo, sequence_parallel=sp,
                                  data_parallel=DataParallelConfig("fp32", False, bucket_numel=H.BUCKET_NUMEL))
        out[name] = train(model, topo, STEPS, CENTER)
    return out


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(run_layouts, 2, args=(JOBS,))


@pytest.mark.parametrize("name", list(JOBS))
def test_layouts_train_as_one_process(name, layouts):
    reference = single_process_run(JOBS[name][0])
    merged: dict[str, torch.Tensor] = {}
    for rank in (r[name] for r in layouts):
        torch.testing.assert_close(torch.tensor(rank["losses"], dtype=torch.float64),
                                   torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-6, atol=0)
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
        for got, want in zip(rank["metrics"] + [rank["eval_metrics"]],
                             reference["metrics"] + [reference["eval_metrics"]]):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        for key, value in rank["state"].items():
            if key in merged:  # replicas (TP-replicated, DP) stay identical
                assert torch.equal(value, merged[key]), key
            merged[key] = value
    assert merged.keys() == reference["state"].keys()
    for key, want in reference["state"].items():
        torch.testing.assert_close(merged[key], want, rtol=1e-6, atol=1e-6, msg=key)
    assert not torch.equal(reference["state"]["output.weight"], reference["initial"]["output.weight"])


# ---- it learns ----

def synthetic_pairs(count: int, seed: int) -> list[MicroBatch]:
    """Pairs with a random 4-token prompt: chosen a fixed 6-token pattern, rejected 6 random tokens."""
    gen = torch.Generator().manual_seed(seed)
    pattern = [10, 11, 12, 13, 14, 15]
    chosen, rejected = [], []
    for _ in range(count):
        prompt = torch.randint(20, PAD, (4,), generator=gen).tolist()
        chosen.append((prompt + pattern, [0] * 4 + [1] * 6))
        rejected.append((prompt + torch.randint(20, PAD, (6,), generator=gen).tolist(), [0] * 4 + [1] * 6))
    ids, labels, mask = alignment_rows(chosen + rejected)
    out = []
    for start in range(0, count, 8):  # 8 pairs a micro-batch, chosen rows first
        rows = list(range(start, start + 8)) + list(range(count + start, count + start + 8))
        out.append(MicroBatch(ids[rows], labels[rows], mask[rows], None, torch.arange(start, start + 8)))
    return out


def test_a_few_seconds_of_training_ranks_held_out_pairs():
    torch.manual_seed(0)
    cfg = H.tiny_config("llama", **LLAMA)
    topo = H.make_topology(H.Layout())
    model = parallelize_model(build_reward_model(cfg), topo, data_parallel=DataParallelConfig("fp32", False))
    optimizer = ShardedAdamW(model, {**H.OPTIM, "lr": 3e-3})
    objective = RewardObjective()
    held_out = synthetic_pairs(64, seed=1)
    before = eval_objective(model, held_out, topo, objective=objective)
    for step in range(10):
        train_step(model, optimizer, synthetic_pairs(16, seed=100 + step), topo, lr=3e-3, clip=1.0,
                   objective=objective)
    after = eval_objective(model, held_out, topo, objective=objective)
    assert after[1]["reward_accuracy"] >= 0.9, (before, after)
    assert after[0] < 0.5 * before[0] and after[1]["reward_margin"] > 1.0, (before, after)
