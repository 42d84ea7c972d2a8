"""DeepSeek-V3's auxiliary-loss-free balancing (model.moe.router_bias_update_rate; runtime/models/moe.py
bias_update, runtime/step.py): after each optimizer step every selection bias moves by rate * sign(mean load - load),
the loads counted over the whole global batch.

- the rule against a hand computation on a known routing, and the counting (training forwards only, once per
  micro-batch under activation checkpointing's recompute);
- rate 0 leaves a nonzero bias bitwise as it was through AdamW with weight decay and clipping;
- one gloo spawn: ep2, dp2 with ZeRO-1 and activation checkpointing, tp2 with sequence parallelism and pp2 give the
  single process's losses (1e-5) and exactly its biases after 3 steps; a checkpoint saved under ep2 (ZeRO-1) after a step
  and loaded into a differently initialized model continues bitwise (the bias is in the checkpoint);
- a nonzero rate without score_bias, on a dense model or under LoRA is refused in one line naming the key."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from runtime.models.moe import SparseMoE, bias_update, route, start_counting
from runtime.schema.model import MoEConfig
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_parallel.test_deepseek_v3_parallel import DEEPSEEK, PIPELINE
from tests.runtime_pipeline import harness as P

RATE = 0.05  # large against the tiny model's sigmoid scores, so the bias changes which experts are chosen
STEPS = 3
BALANCED = {**DEEPSEEK, "moe": dataclasses.replace(DEEPSEEK["moe"], router_bias_update_rate=RATE)}
PIPELINE_BALANCED = {**PIPELINE, "num_layers": P.NUM_LAYERS,
                     "moe": dataclasses.replace(PIPELINE["moe"], router_bias_update_rate=RATE)}
L = H.Layout
JOBS = {"ep2": (BALANCED, L(dp=2, ep=2)),
        "dp2-zero1-recompute": (BALANCED, L(dp=2, zero1=True, activation_checkpointing="full")),
        "tp2-sp": (BALANCED, L(tp=2, sequence_parallel=True))}
BIAS = "layers.{}.mlp.selection.bias"


def test_update_rule_by_hand():
    # 6 tokens, 4 experts, top-2 of sigmoid scores plus the bias (no groups): the bias lifts expert 3 over expert 1
    # for the tokens whose two best are 0 and 1.
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5], [2.0, 1.0, -1.0, 0.5], [0.0, 3.0, 2.0, -2.0],
                           [1.0, 0.9, -3.0, 0.0], [-1.0, -1.0, 1.0, 2.0], [3.0, -1.0, 0.0, 1.0]])
    routing = route(logits, 2, activation="sigmoid", score_bias=torch.tensor([0.0, -0.2, 0.0, 0.1]))
    chosen = [sorted(row) for row in routing.experts.tolist()]
    assert chosen == [[0, 3], [0, 3], [1, 2], [0, 3], [2, 3], [0, 3]]
    loads = torch.tensor([[4.0, 1.0, 2.0, 5.0]])  # counted by hand from `chosen`; mean 3
    assert torch.equal(bias_update(loads, 0.01), torch.tensor([[-0.01, 0.01, 0.01, -0.01]]))
    # A load at the mean stays; layers are independent; every change is exactly +-rate or 0.
    assert torch.equal(bias_update(torch.tensor([[3.0, 3.0, 1.0, 5.0], [0.0, 0.0, 0.0, 12.0]]), 0.5),
                       torch.tensor([[0.0, 0.0, 0.5, -0.5], [0.5, 0.5, 0.5, -0.5]]))


def test_counting_training_forwards_once_each():
    from runtime.parallel.parallelize import checkpoint_module

    torch.manual_seed(0)
    moe = SparseMoE(8, 6, 4, 2, activation="sigmoid", score_bias=True, capacity_factor=0.5)
    x = torch.randn(2, 5, 8, requires_grad=True)
    (selection,) = start_counting(moe)
    moe.eval()
    moe(x)
    assert selection.routed.sum() == 0, "an evaluation forward does not count"
    moe.train()
    with torch.no_grad():
        moe(x)
    assert selection.routed.sum() == 0, "a forward without gradients (reference scoring) does not count"
    checkpoint_module(moe)
    moe(x).sum().backward()  # recomputed inside backward: counted once
    moe(x[:1]).sum().backward()
    experts = route(moe.router(x.detach().reshape(-1, 8)), 2, activation="sigmoid",
                    score_bias=selection.bias.detach()).experts
    expected = torch.bincount(torch.cat([experts.flatten(), experts[:5].flatten()]), minlength=4).float()
    assert torch.equal(selection.routed, expected), "every routed assignment, before capacity drops any"


def _train_single(rate: float, steps: int = 2) -> list[torch.Tensor]:
    from runtime.models import build_model
    from runtime.parallel import DataParallelConfig, ShardedAdamW, parallelize_model
    from runtime.step import train_step

    cfg = H.tiny_config("llama", **{**DEEPSEEK, "moe": dataclasses.replace(DEEPSEEK["moe"],
                                                                            router_bias_update_rate=rate)})
    model = build_model(cfg)
    bias = model.get_parameter(BIAS.format(1))
    with torch.no_grad():
        bias.copy_(torch.tensor([0.3, -0.1, 0.05, 0.2]))
    seen = [bias.detach().clone()]
    topo = H.make_topology(L())
    model = parallelize_model(model, topo, data_parallel=DataParallelConfig("fp32", False))
    optimizer = ShardedAdamW(model, H.OPTIM)  # weight decay 0.1
    for step in range(steps):
        train_step(model, optimizer, H.micro_batches_for(step, cfg.vocab_size, topo), topo, lr=1e-2, clip=0.1)
        seen.append(model.get_parameter(BIAS.format(1)).detach().clone())
    return seen


def test_rate_zero_leaves_the_bias_bitwise_and_a_rate_moves_it_by_steps_of_it():
    first, *after = _train_single(0.0)
    assert all(torch.equal(first, bias) for bias in after)
    seen = _train_single(RATE)
    for before, bias in zip(seen, seen[1:]):  # each step: +-RATE or 0 per expert (fp32 rounding of the sum aside)
        steps = (bias - before) / RATE
        assert torch.allclose(steps, steps.round(), atol=1e-5) and steps.round().abs().max() <= 1
    assert not torch.equal(seen[0], seen[1])


def _suite(directory: str) -> dict:
    out = {name: H.train_job("llama", overrides, layout, steps=STEPS) for name, (overrides, layout) in JOBS.items()}
    out["pp2"] = P.train("llama", PIPELINE_BALANCED, P.PipelineLayout(pp=2), steps=STEPS)
    out["resume"] = _save_and_resume(directory)
    return out


def _save_and_resume(directory: str) -> dict:
    """ep2 with ZeRO-1: a step, save, a second; a model of another seed loaded from the save, then the same second
    step."""
    import torch.distributed as dist

    from runtime.checkpoint import Checkpointer, load_checkpoint, resolve_checkpoint
    from runtime.models import build_model
    from runtime.parallel import DataParallelConfig, ShardedAdamW, gather_full_state_dict, parallelize_model
    from runtime.step import train_step

    topo = H.make_topology(L(dp=2, ep=2))

    def build(seed: int):
        cfg = H.tiny_config("llama", **BALANCED, seed=seed)
        model = parallelize_model(build_model(cfg), topo, data_parallel=DataParallelConfig("fp32", True))
        return cfg, model, ShardedAdamW(model, H.OPTIM)

    def step(cfg, model, optimizer, index: int) -> float:
        return train_step(model, optimizer, H.micro_batches_for(index, cfg.vocab_size, topo), topo,
                          lr=H.OPTIM["lr"], clip=1.0).loss

    cfg, model, optimizer = build(1234)
    step(cfg, model, optimizer, 0)
    saver = Checkpointer(directory, rank=dist.get_rank(), world_size=dist.get_world_size(), token="0",
                         async_save=False)
    saver.save(1, model, optimizer, topo, extra={"step": 1}, config={})
    dist.barrier()
    saved_bias = gather_full_state_dict(model, topo)[BIAS.format(1)].clone()
    first = (step(cfg, model, optimizer, 1), gather_full_state_dict(model, topo)[BIAS.format(1)].clone())
    cfg, model, optimizer = build(99)
    storage, checkpoint = resolve_checkpoint(directory)
    load_checkpoint(storage, checkpoint, model, optimizer, topo, rank=dist.get_rank())
    loaded_bias = gather_full_state_dict(model, topo)[BIAS.format(1)].clone()
    second = (step(cfg, model, optimizer, 1), gather_full_state_dict(model, topo)[BIAS.format(1)].clone())
    return {"saved_bias": saved_bias, "loaded_bias": loaded_bias, "first": first, "second": second}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_suite, 2, args=(str(tmp_path_factory.mktemp("balancing")),))


@functools.cache
def _reference(pipeline: bool) -> dict:
    torch.set_num_threads(1)
    if pipeline:
        return H.train_job("llama", PIPELINE_BALANCED, L(), steps=STEPS)
    return H.train_job("llama", BALANCED, L(), steps=STEPS)


@pytest.mark.long("one gloo spawn trains ep2, dp2 with ZeRO-1 and recompute, tp2-sp and pp2, and resumes ep2")
def test_layouts_balance_as_one_process(two_ranks):
    for name in (*JOBS, "pp2"):
        ref = _reference(name == "pp2")
        biases = [key for key in ref["state"] if key.endswith("selection.bias")]
        assert biases and any(ref["state"][key].abs().sum() > 0 for key in biases), "the reference moved its biases"
        for rank in two_ranks:
            run = rank[name]
            H.assert_trains_as_reference(run, ref)
            for key in biases:
                if key in run["state"]:  # pp2: each stage its own layers
                    assert torch.equal(run["state"][key], ref["state"][key]), (name, key)
        assert all(any(key in rank[name]["state"] for rank in two_ranks) for key in biases), name
    # The same losses with the bias frozen would differ: the balancing changed the routing.
    frozen = H.train_job("llama", DEEPSEEK, L(), steps=STEPS)
    assert frozen["losses"][1:] != _reference(False)["losses"][1:]


@pytest.mark.long("its module fixture trains under gloo once")
def test_resume_continues_bitwise(two_ranks):
    for rank in two_ranks:
        resumed = rank["resume"]
        assert torch.equal(resumed["saved_bias"], resumed["loaded_bias"]) and resumed["saved_bias"].abs().sum() > 0
        assert resumed["first"][0] == resumed["second"][0]
        assert torch.equal(resumed["first"][1], resumed["second"][1])


def test_refused_in_one_line():
    from runtime.schema.model import ModelConfig

    plain = dataclasses.replace(DEEPSEEK["moe"], score_bias=False, router_bias_update_rate=0.001)
    with pytest.raises(ValueError, match=r"^model\.moe\.router_bias_update_rate: 0\.001 updates the expert selection "
                                         r"bias, which needs model\.moe\.score_bias=true [^\n]*$"):
        ModelConfig(**{**H.TINY["llama"], **DEEPSEEK, "moe": plain})


@pytest.mark.parametrize("moe, lora, expected", [
    ({"num_experts": 4, "score_bias": False}, False,
     r"model\.moe\.router_bias_update_rate: 0\.001 updates the expert selection bias, which needs "),
    ({"num_experts": 0}, False, r"model\.moe\.router_bias_update_rate: 0\.001 updates the expert selection bias of "
                                r"MoE layers, which a dense model \(num_experts 0\) has none of; set it to 0\.0"),
    ({"num_experts": 4, "score_bias": True, "router_activation": "sigmoid"}, True,
     r"model\.moe\.router_bias_update_rate: 0\.001 with LoRA: "),
])
def test_refused_by_the_stage_parser(moe, lora, expected):
    from runtime.schema.reader import Report, Section
    from runtime.schema.rules import bias_update
    from runtime.schema.training import parse_moe

    report = Report()
    parsed = parse_moe(Section({"moe": {**moe, "router_bias_update_rate": 0.001}}, "training.model", report))
    problems = [problem for problem in report.errors]
    if parsed is not None:
        problems.append(bias_update(parsed.router_bias_update_rate, parsed.score_bias, "training.", lora=lora))
    lines = [p for p in problems if p]
    assert len(lines) == 1 and lines[0].startswith("training.") and re_search(expected, lines[0]), lines


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_runtime_refuses_an_architecture_without_the_bias():
    from runtime.models import build_model
    from runtime.parallel import DataParallelConfig, ShardedAdamW, parallelize_model
    from runtime.step import train_step

    moe = MoEConfig(num_experts=4, top_k=2, score_bias=True, router_bias_update_rate=0.001)  # llama: not built
    cfg = H.tiny_config("llama", moe=moe)
    topo = H.make_topology(L())
    model = parallelize_model(build_model(cfg), topo, data_parallel=DataParallelConfig("fp32", False))
    with pytest.raises(ValueError, match=r"^training\.model\.moe\.router_bias_update_rate: 0\.001 updates the expert "
                                         r"selection bias, which these MoE layers do not have [^\n]*$"):
        train_step(model, ShardedAdamW(model, H.OPTIM), H.micro_batches_for(0, cfg.vocab_size, topo), topo,
                   lr=1e-3, clip=None)


@pytest.mark.parametrize("enabled", [False, True])
def test_nemo_expert_bias_keys(tmp_path, enabled):
    """Megatron-core's moe_router_enable_expert_bias / moe_router_bias_update_rate in a NeMo file: the rate alone is
    what Megatron ignores (so is it here, said in explain-config's rows); the bias itself is refused in one line."""
    from launcher import nxdt_config
    from tests.launcher.helpers import REPO

    text = (REPO / "tests/fixtures/nemo/training_mixtral_mixtral_8x7b.yaml").read_text()
    extra = f"  moe_router_enable_expert_bias: {enabled}\n  moe_router_bias_update_rate: 0.001\n"
    path = tmp_path / "mixtral.yaml"
    path.write_text(text.replace("  moe_grouped_gemm: false\n", "  moe_grouped_gemm: false\n" + extra))
    mapping = nxdt_config.map_file(str(path))
    if enabled:
        (line,) = [e for e in mapping.errors if "moe_router_enable_expert_bias" in e]
        assert "\n" not in line and "set training.model.moe.router_bias_update_rate" in line, mapping.errors
        return
    assert not mapping.errors and "router_bias_update_rate" not in mapping.training["model"]["moe"]
    rows = {key: what for key, _, what in mapping.rows}
    assert rows["model.moe_router_bias_update_rate"].startswith("ignored: ")
