"""runtime/rl/rollout.py: the rows and masks it builds, greedy completions and log-probs under tensor and pipeline
parallelism and sampled ones under tensor, pipeline and data parallelism (2 gloo ranks) equal to one process's, and
seeded sampling reproducible."""
from __future__ import annotations

import pytest
import torch

from runtime.models import build_model
from runtime.parallel import DataParallelConfig, ParallelDims, Topology, parallelize_model
from runtime.rl.grpo import GRPOConfig
from runtime.rl.rewards import exact_match
from runtime.generate import generate
from runtime.rl.rollout import build_rows, micro_batches, prompt_seed, rollout, sample
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

MAX_POSITIONS = 32
PROMPTS = [[5, 9, 2], [7, 1], [11, 12, 13, 14], [100, 4, 6]]
ANSWERS = ["20", "", "1 2", "x"]
STOPS = {3, 17, 40, 77}  # common enough that some completions stop before max_completion_length


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def first_token_reward(completion: str, answer: str) -> float:
    """Rewards that differ within a group: the completion's first token id, mod 5."""
    return float(int(completion.split()[0]) % 5) if completion else -1.0


def tiny_model(topo: Topology):
    cfg = H.tiny_config("llama", max_position_embeddings=MAX_POSITIONS, init_method_std=0.1)
    return parallelize_model(build_model(cfg), topo, data_parallel=DataParallelConfig("fp32", False))


def run(topo: Topology, prompts: list, indices: list, temperature: float, seed: int = 3, beta: float = 0.04,
        reward=first_token_reward, scale: str = "batch") -> dict:
    cfg = GRPOConfig(num_generations=4, max_completion_length=6, temperature=temperature, top_p=0.9, beta=beta,
                     scale_rewards=scale)
    model = tiny_model(topo)
    reference = tiny_model(topo)
    with torch.no_grad():  # a reference that is not the policy
        for p in reference.parameters():
            p.mul_(0.9)
    out = rollout(model, prompts, [ANSWERS[i] for i in indices], config=cfg, reward=reward, decode=decode,
                  stop_ids=STOPS, topo=topo, seed=seed, prompt_indices=indices, micro_batch_size=3,
                  reference=reference)
    return {"completions": out.completions, "old": out.table.old_logps, "ref": out.table.ref_logps,
            "advantages": out.table.advantages, "rewards": out.table.rewards, "mask": out.loss_mask,
            "metrics": out.metrics, "texts": out.texts}


def one_process(temperature: float, seed: int = 3, **kwargs) -> dict:
    return run(Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1)), PROMPTS, [0, 1, 2, 3], temperature,
               seed, **kwargs)


def _ranks() -> dict:
    tp2 = Topology.build(ParallelDims(tp=2, pp=1, dp=1, world_size=2))
    out = {"tp2-greedy": run(tp2, PROMPTS, [0, 1, 2, 3], 0.0), "tp2-sampled": run(tp2, PROMPTS, [0, 1, 2, 3], 1.0)}
    dp2 = Topology.build(ParallelDims(tp=1, pp=1, dp=2, world_size=2))
    mine = [0, 1] if dp2.dp.rank == 0 else [2, 3]
    out["dp2-sampled"] = run(dp2, [PROMPTS[i] for i in mine], mine, 1.0)
    return out


def test_tensor_and_data_parallel_rollouts_equal_one_process():
    ranks = run_distributed(_ranks, world_size=2)
    greedy, sampled = one_process(0.0), one_process(1.0)
    assert len({tuple(c) for c in sampled["completions"][:4]}) > 1, "sampling gives a group different completions"
    assert any(c[-1] in STOPS for c in sampled["completions"]) and any(len(c) == 6 for c in sampled["completions"])
    for rank in ranks:
        for name, expected in (("tp2-greedy", greedy), ("tp2-sampled", sampled)):
            got = rank[name]
            assert got["completions"] == expected["completions"], name
            for key in ("old", "ref", "advantages", "rewards", "mask"):
                torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6, msg=f"{name} {key}")
            assert got["metrics"] == pytest.approx(expected["metrics"], rel=1e-6)
    # Data parallelism: each rank sampled its 2 prompts; the batch-scaled advantages use all 4 prompts' rewards.
    halves = [rank["dp2-sampled"] for rank in ranks]
    assert halves[0]["completions"] + halves[1]["completions"] == sampled["completions"]
    for key in ("advantages", "rewards"):
        torch.testing.assert_close(torch.cat([h[key] for h in halves]), sampled[key], rtol=1e-6, atol=1e-6)
    assert halves[0]["metrics"] == pytest.approx(sampled["metrics"], rel=1e-6)


def _pipeline_ranks() -> dict:
    pp2 = Topology.build(ParallelDims(tp=1, pp=2, dp=1, world_size=2))  # the tiny llama's 2 layers, 1 per stage
    return {"pp2-greedy": run(pp2, PROMPTS, [0, 1, 2, 3], 0.0), "pp2-sampled": run(pp2, PROMPTS, [0, 1, 2, 3], 1.0)}


def test_pipeline_parallel_rollouts_equal_one_process():
    """Both stages generate the completions one process does (the last stage picks them), and the rewards,
    advantages and old and reference log-probs that follow are one process's too."""
    ranks = run_distributed(_pipeline_ranks, world_size=2)
    greedy, sampled = one_process(0.0), one_process(1.0)
    for rank in ranks:
        for name, expected in (("pp2-greedy", greedy), ("pp2-sampled", sampled)):
            got = rank[name]
            assert got["completions"] == expected["completions"] and got["texts"] == expected["texts"], name
            for key in ("old", "ref", "advantages", "rewards", "mask"):
                torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6, msg=f"{name} {key}")
            assert got["metrics"] == pytest.approx(expected["metrics"], rel=1e-6)


def test_sampling_is_reproducible_and_greedy_groups_are_identical():
    first, again, other = one_process(1.0, seed=11, beta=0.0), one_process(1.0, seed=11, beta=0.0), \
        one_process(1.0, seed=12, beta=0.0)
    assert first["completions"] == again["completions"]
    torch.testing.assert_close(first["old"], again["old"], rtol=0, atol=0)
    assert first["completions"] != other["completions"]
    assert first["ref"] is None
    greedy = one_process(0.0, beta=0.0, scale="group")
    for group in range(len(PROMPTS)):
        assert len({tuple(c) for c in greedy["completions"][4 * group:4 * group + 4]}) == 1
    assert torch.equal(greedy["advantages"], torch.zeros(16))  # equal rewards: no signal
    assert greedy["metrics"]["frac_reward_zero_std"] == 1.0


def test_a_prompts_completions_do_not_depend_on_the_order_or_split_of_the_batch():
    """sample() draws all prompts in one generate() call; each prompt's G completions are those of generate() over
    its G rows alone seeded by (seed, its index), whatever the other prompts, their order and the split."""
    model = tiny_model(Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1)))
    cfg = GRPOConfig(num_generations=4, max_completion_length=6, temperature=1.0, top_p=0.9)
    G, seed = cfg.num_generations, 5

    def per_prompt(indices: list[int]) -> dict[int, list]:
        got = sample(model, [PROMPTS[i] for i in indices], cfg, stops=STOPS, seed=seed, prompt_indices=indices)
        return {index: got[G * k:G * k + G] for k, index in enumerate(indices)}

    whole = per_prompt([0, 1, 2, 3])
    assert per_prompt([3, 1, 0, 2]) == whole
    assert {**per_prompt([2]), **per_prompt([0, 3]), **per_prompt([1])} == whole
    for index, completions in whole.items():  # the stop token kept, as the finished callback leaves it
        alone = generate(model, [PROMPTS[index]] * G, max_new_tokens=6, temperature=1.0, top_p=0.9,
                         seed=prompt_seed(seed, index), stop_ids=STOPS)
        assert [c[:-1] if c[-1] in STOPS else c for c in completions] == alone
    assert any(c[-1] in STOPS for group in whole.values() for c in group)


def test_rows_mask_the_completion_through_its_stop_token():
    prompts = [[5, 6, 7], [8]]
    completions = [[20, 21, 3], [22], [30, 31, 32, 33], [3]]  # rows 1 and 2 truncated (no stop token)
    input_ids, labels, mask, lengths, truncated = build_rows(prompts, completions, 2, {3}, 0, False)
    assert input_ids.shape == (4, 5)  # the longest row: 3 + 3 tokens, less the last one
    assert input_ids[0].tolist() == [5, 6, 7, 20, 21] and labels[0].tolist() == [6, 7, 20, 21, 3]
    assert mask[0].tolist() == [0, 0, 1, 1, 1] and mask[1].tolist() == [0, 0, 1, 0, 0]
    assert input_ids[3].tolist() == [8, 0, 0, 0, 0] and labels[3].tolist() == [3, 0, 0, 0, 0]
    assert mask[3].tolist() == [1, 0, 0, 0, 0] and mask[2].tolist() == [1, 1, 1, 1, 0]
    assert lengths.tolist() == [3, 1, 4, 1] and truncated.tolist() == [False, True, True, False]
    masked = build_rows(prompts, completions, 2, {3}, 0, True)[2]
    assert masked[1].sum() == 0 and masked[2].sum() == 0 and torch.equal(masked[0], mask[0])


def test_the_rollout_rewards_decoded_completions_and_cuts_micro_batches():
    """exact_match on the decoded completion (stop token dropped); micro-batches carry each row's id."""
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    greedy = one_process(0.0, beta=0.0)
    answers = {0: greedy["texts"][0], 1: "no"}
    cfg = GRPOConfig(num_generations=4, max_completion_length=6, temperature=0.0)
    out = rollout(tiny_model(topo), PROMPTS[:2], [answers[0], answers[1]], config=cfg, reward=exact_match,
                  decode=decode, stop_ids=STOPS, topo=topo, seed=3, prompt_indices=[0, 1], micro_batch_size=3)
    assert out.table.rewards.tolist() == [1.0] * 4 + [0.0] * 4
    batches = micro_batches(out, 3)
    assert [b.pair_ids.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert torch.equal(torch.cat([b.loss_mask for b in batches]), out.loss_mask)
