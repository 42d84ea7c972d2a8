"""runtime/generate.py under pipeline parallelism, in real gloo ranks: greedy and group-seeded sampled completions
at pp2, pp2 x tp2 (4 ranks), pp2 x dp2 (each replica its own prompts) and pp2 with virtual stages equal one
process's, token for token, with stop ids ending rows at different steps; every stage returns the same tokens and
holds KV caches for its own layers only."""
from __future__ import annotations

from runtime.generate import PipelinedDecoding, generate
from runtime.models import build_model
from runtime.models.layers import Attention
from runtime.parallel import ParallelDims, Topology, parallelize_model
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

MAX_POSITIONS = 48
PROMPTS = [[5, 9, 2, 7, 1], [3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100, 4]]
ROWS = [prompt for prompt in PROMPTS for _ in range(2)]  # two completions per prompt, a seed per pair
SEEDS = [101, 7, 55, 3]
NEW = 10
STOPS = {4, 9, 21, 33}
NUM_LAYERS = 4


def tiny(arch: str = "llama"):
    cfg = H.tiny_config(arch, max_position_embeddings=MAX_POSITIONS, init_method_std=0.1, num_layers=NUM_LAYERS)
    return build_model(cfg).eval()


def completions(model, topo: Topology | None = None) -> dict:
    sampled = dict(max_new_tokens=NEW, stop_ids=STOPS, vocab_size=40, topo=topo)
    return {"greedy": generate(model, PROMPTS, max_new_tokens=NEW, topo=topo),
            "greedy-stops": generate(model, PROMPTS, pad_id=7, **sampled),
            "sampled": generate(model, ROWS, temperature=1.5, top_p=0.9, group_seeds=SEEDS, **sampled),
            "seeded": generate(model, PROMPTS, temperature=1.0, seed=5, **sampled)}


def _layout(tp: int, pp: int, dp: int, world: int, vpp: int | None = None) -> dict:
    topo = Topology.build(ParallelDims(tp=tp, pp=pp, dp=dp, world_size=world))
    out = {}
    for arch in ("gpt", "llama"):
        model = parallelize_model(tiny(arch), topo, virtual_pp=vpp).eval()
        calls = []
        original = PipelinedDecoding.__call__

        def counted(self, *args, _original=original):
            calls.append(1)
            return _original(self, *args)

        PipelinedDecoding.__call__ = counted
        try:
            out[arch] = completions(model, topo)
        finally:
            PipelinedDecoding.__call__ = original
        out[f"{arch}-forwards"] = len(calls)  # every stage runs the same number of steps
        out[f"{arch}-cached-layers"] = len([m for m in model.modules() if isinstance(m, Attention)])
        assert all(m.kv_cache is None for m in model.modules() if isinstance(m, Attention))
    out["dp_rank"], out["pp_rank"] = topo.dp.rank, topo.pp.rank
    return out


def _pp2_and_virtual_stages() -> dict:
    return {"pp2": _layout(1, 2, 1, 2), "vpp2": _layout(1, 2, 1, 2, vpp=2)}


def _pp2_tp2() -> dict:
    return _layout(2, 2, 1, 4)


def _pp2_dp2() -> dict:
    topo = Topology.build(ParallelDims(tp=1, pp=2, dp=2, world_size=4))
    model = parallelize_model(tiny(), topo).eval()
    mine = slice(0, 2) if topo.dp.rank == 0 else slice(2, 4)
    rows = [prompt for prompt in PROMPTS[mine] for _ in range(2)]
    return {"dp_rank": topo.dp.rank,
            "sampled": generate(model, rows, max_new_tokens=NEW, stop_ids=STOPS, vocab_size=40, temperature=1.5,
                                top_p=0.9, group_seeds=SEEDS[mine], topo=topo)}


def _expected() -> dict:
    return {arch: completions(tiny(arch)) for arch in ("gpt", "llama")}


def _check(ranks: list[dict], expected: dict, layers_per_rank: int) -> None:
    for rank in ranks:
        for arch in ("gpt", "llama"):
            assert rank[arch] == expected[arch], (arch, rank["pp_rank"])
            assert rank[f"{arch}-cached-layers"] == layers_per_rank
            assert rank[f"{arch}-forwards"] == ranks[0][f"{arch}-forwards"]


def test_pipeline_stages_generate_what_one_process_does():
    expected = _expected()
    llama = expected["llama"]
    assert len({len(t) for t in llama["greedy-stops"]}) > 1 and len({len(t) for t in llama["sampled"]}) > 1
    assert llama["sampled"] != llama["greedy-stops"]
    ranks = run_distributed(_pp2_and_virtual_stages, world_size=2)
    _check([rank["pp2"] for rank in ranks], expected, NUM_LAYERS // 2)
    _check([rank["vpp2"] for rank in ranks], expected, NUM_LAYERS // 2)  # chunks of one layer, two per rank


def test_pipeline_with_tensor_parallel_stages_generates_what_one_process_does():
    ranks = run_distributed(_pp2_tp2, world_size=4)
    _check(ranks, _expected(), NUM_LAYERS // 2)


def test_pipeline_replicas_each_generate_their_own_prompts():
    ranks = run_distributed(_pp2_dp2, world_size=4)
    whole = _expected()["llama"]["sampled"]
    for rank in ranks:
        assert rank["sampled"] == (whole[:4] if rank["dp_rank"] == 0 else whole[4:])


def test_a_pipeline_stage_without_a_topology_is_a_one_line_error():
    from runtime.parallel.pipeline import split_into_stages
    from runtime.parallel.plan import ShardingPlan

    stage = split_into_stages(tiny(), Topology.offline(ParallelDims(tp=1, pp=2, dp=1, world_size=2), 0),
                              ShardingPlan(1), virtual_pp=None, sequence_parallel=False)
    try:
        generate(stage, PROMPTS, max_new_tokens=1)
    except ValueError as error:
        assert str(error).startswith("generation from a pipeline stage needs its topology: pass topo=")
    else:
        raise AssertionError("no error")
