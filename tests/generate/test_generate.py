"""runtime/generate.py against the plainest possible reference: re-running the whole forward over every token so
far and taking the argmax, one prompt at a time. The KV cache, left-padded batches, stop ids, the length limit,
LoRA adapters and tensor parallelism (two gloo processes) must all give the reference's tokens exactly."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.generate import generate
from runtime.models import build_model
from runtime.parallel import ParallelDims, Topology, parallelize_model
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

MAX_POSITIONS = 48
# Prompts of unequal lengths, so a batch needs left padding (the longest pads nothing, the shortest 8 tokens).
PROMPTS = [[5, 9, 2, 7, 1], [3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100, 4]]
NEW = 12


def tiny(arch: str, **overrides):
    # A larger init spread than the default makes the logits decisive, so greedy never hinges on float noise.
    cfg = H.tiny_config(arch, max_position_embeddings=MAX_POSITIONS, init_method_std=0.1, **overrides)
    return build_model(cfg).eval()


@torch.no_grad()
def full_forward_greedy(model: nn.Module, prompt: list[int], max_new_tokens: int, stop_ids=()) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        if token in stop_ids:
            break
        ids.append(token)
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_kv_cache_equals_rerunning_the_full_forward(arch):
    model = tiny(arch)
    for prompt in PROMPTS:
        assert generate(model, [prompt], max_new_tokens=NEW) == [full_forward_greedy(model, prompt, NEW)]
    assert all(attention.kv_cache is None for attention in (layer.attn for layer in model.layers))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_batch_of_unequal_prompts_equals_one_by_one(arch):
    model = tiny(arch)
    alone = [generate(model, [prompt], max_new_tokens=NEW)[0] for prompt in PROMPTS]
    assert generate(model, PROMPTS, max_new_tokens=NEW, pad_id=0) == alone
    assert generate(model, PROMPTS, max_new_tokens=NEW, pad_id=77) == alone  # the pad id never matters
    assert len({tuple(tokens) for tokens in alone}) == len(PROMPTS)  # the rows really differ


def test_lora_adapters_generate_through_the_cache():
    model = H.fine_tuning_model(H.tiny_config("llama", max_position_embeddings=MAX_POSITIONS, init_method_std=0.1),
                                "lora").eval()
    plain = tiny("llama")
    out = generate(model, PROMPTS, max_new_tokens=NEW)
    assert out == [full_forward_greedy(model, prompt, NEW) for prompt in PROMPTS]
    assert out != generate(plain, PROMPTS, max_new_tokens=NEW)  # the adapters act


def test_stop_ids_end_each_row_and_are_not_returned():
    model = tiny("llama")
    free = generate(model, PROMPTS, max_new_tokens=NEW)
    # Per row, a stop id that first appears at index 3 of its free run: the row keeps the 3 tokens before it.
    row = 1
    stop = next(t for i, t in enumerate(free[row]) if i >= 3 and t not in free[row][:i])
    cut = free[row].index(stop)
    stopped = generate(model, PROMPTS, max_new_tokens=NEW, stop_ids={stop})
    assert stopped[row] == free[row][:cut]
    for other, tokens in enumerate(free):  # the other rows stop at that id too, where it appears, or run on
        expected = tokens[:tokens.index(stop)] if stop in tokens else tokens
        assert stopped[other] == expected == full_forward_greedy(model, PROMPTS[other], NEW, {stop})
    assert generate(model, PROMPTS, max_new_tokens=3) == [tokens[:3] for tokens in free]


def test_a_row_ends_at_the_model_length():
    model = tiny("gpt")  # learned positions: a position past the table would fail loudly
    long = list(range(1, MAX_POSITIONS - 2))  # 45 tokens: 3 more can be fed back, so 4 new tokens
    out = generate(model, [long, [7]], max_new_tokens=10)
    assert len(out[0]) == 4 and len(out[1]) == 10
    assert out[0] == full_forward_greedy(model, long, 4)
    with pytest.raises(ValueError, match="prompt 0 has 49 tokens; a prompt needs 1 to 48"):
        generate(model, [list(range(MAX_POSITIONS + 1))], max_new_tokens=1)


def test_top_p_sampling_is_reproducible_and_top_p_near_zero_is_greedy():
    model = tiny("llama")
    sample = dict(max_new_tokens=NEW, temperature=1.5, top_p=0.9)
    first = generate(model, PROMPTS, seed=3, **sample)
    assert generate(model, PROMPTS, seed=3, **sample) == first
    assert generate(model, PROMPTS, seed=4, **sample) != first
    assert first != generate(model, PROMPTS, max_new_tokens=NEW)
    # A nucleus of one token is the argmax, whatever the temperature and seed.
    assert generate(model, PROMPTS, max_new_tokens=NEW, temperature=2.0, top_p=1e-6, seed=9) == \
        generate(model, PROMPTS, max_new_tokens=NEW)
    # vocab_size keeps the draws below it (the model's vocabulary is padded past the tokenizer's).
    limited = generate(model, PROMPTS, seed=3, vocab_size=20, max_new_tokens=NEW, temperature=3.0)
    assert max(max(tokens) for tokens in limited) < 20


def test_bad_arguments_and_unsupported_layouts_are_one_line_errors():
    model = tiny("gpt")
    for kwargs, message in [({"max_new_tokens": 0}, "max_new_tokens: 0 must be a positive integer"),
                            ({"max_new_tokens": 1, "temperature": -1.0}, "temperature: -1.0 must be >= 0"),
                            ({"max_new_tokens": 1, "top_p": 0.0}, r"top_p: 0.0 must be in \(0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            generate(model, PROMPTS, **kwargs)
    with pytest.raises(ValueError, match="prompt 1 has 0 tokens"):
        generate(model, [[1], []], max_new_tokens=1)
    with pytest.raises(ValueError, match="generation needs a CausalLM .whole, or this rank's pipeline stage of one.,"):
        generate(nn.Linear(2, 2), PROMPTS, max_new_tokens=1)
    assert generate(model, [], max_new_tokens=1) == []


def _tensor_parallel_ranks() -> dict:
    """In each of 2 gloo processes: the tiny models at tp=2, greedy and sampled; and the sequence-parallel refusal."""
    topo = Topology.build(ParallelDims(tp=2, pp=1, dp=1, world_size=2))
    out = {}
    for arch in ("gpt", "llama"):
        model = parallelize_model(tiny(arch), topo).eval()
        out[f"{arch}-greedy"] = generate(model, PROMPTS, max_new_tokens=NEW)
        out[f"{arch}-sampled"] = generate(model, PROMPTS, max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=5)
    lora = H.fine_tuning_model(H.tiny_config("llama", max_position_embeddings=MAX_POSITIONS, init_method_std=0.1),
                               "lora")
    out["lora-greedy"] = generate(parallelize_model(lora, topo).eval(), PROMPTS, max_new_tokens=NEW)
    try:
        generate(parallelize_model(tiny("gpt"), topo, sequence_parallel=True), PROMPTS, max_new_tokens=1)
    except ValueError as error:
        out["sequence_parallel"] = str(error)
    return out


def test_tensor_parallel_ranks_agree_with_one_process():
    ranks = run_distributed(_tensor_parallel_ranks, world_size=2)
    assert ranks[0] == ranks[1]
    tp2 = ranks[0]
    for arch in ("gpt", "llama"):
        model = tiny(arch)
        assert tp2[f"{arch}-greedy"] == generate(model, PROMPTS, max_new_tokens=NEW)
        assert tp2[f"{arch}-sampled"] == generate(model, PROMPTS, max_new_tokens=NEW, temperature=1.0, top_p=0.9,
                                                  seed=5)
    lora = H.fine_tuning_model(H.tiny_config("llama", max_position_embeddings=MAX_POSITIONS, init_method_std=0.1),
                               "lora")
    assert tp2["lora-greedy"] == generate(lora, PROMPTS, max_new_tokens=NEW)
    assert tp2["sequence_parallel"].startswith("generation does not support sequence parallelism")


def test_group_seeds_sample_each_group_as_it_samples_alone():
    """Two completions per prompt in one batch, each pair from its own seed, equal the pairs sampled by separate
    calls; with stop ids, so groups end at different steps (and one drawing no more does not shift the others)."""
    model = tiny("llama")
    rows = [prompt for prompt in PROMPTS for _ in range(2)]
    seeds = [101, 7, 55, 3]
    for temperature, top_p, stops in [(1.0, 1.0, ()), (1.5, 0.9, {4, 9, 21, 33})]:
        sample = dict(max_new_tokens=NEW, temperature=temperature, top_p=top_p, stop_ids=stops, vocab_size=40)
        alone = [t for prompt, s in zip(PROMPTS, seeds) for t in generate(model, [prompt] * 2, seed=s, **sample)]
        batched = generate(model, rows, group_seeds=seeds, **sample)
        assert batched == alone
        assert len({len(t) for t in batched}) > 1 or not stops  # rows really end at different steps
        pairs = [alone[i:i + 2] for i in range(0, len(alone), 2)]
        reordered = generate(model, rows[::-1], group_seeds=seeds[::-1], **sample)  # the groups in reverse
        assert reordered == [t for pair in pairs[::-1] for t in pair]
        assert generate(model, rows, group_seeds=seeds[::-1], **sample) != batched
    with pytest.raises(ValueError, match="group_seeds: 3 seeds for 8 prompts"):
        generate(model, rows, max_new_tokens=1, group_seeds=[1, 2, 3])


@pytest.mark.parametrize("fixed", [False, True])
def test_the_cache_over_the_tokens_so_far_or_whole_gives_the_same_tokens(monkeypatch, fixed):
    """Decode steps attend over the cache's filled prefix, or over all of it (fixed shapes: XLA's one graph): the
    same tokens either way, greedy and sampled, as re-running the full forward."""
    model = tiny("llama")
    monkeypatch.setattr("runtime.generate.fixed_shapes", lambda device: fixed)
    assert generate(model, PROMPTS, max_new_tokens=NEW) == [full_forward_greedy(model, p, NEW) for p in PROMPTS]
    sampled = dict(max_new_tokens=NEW, temperature=1.0, top_p=0.9)
    assert [generate(model, [p], seed=5, **sampled)[0] for p in PROMPTS] == \
        generate(model, PROMPTS, group_seeds=[5] * len(PROMPTS), **sampled)
