"""At the sizes the recipes name: a rank of Llama 3 8B, 70B and 3.1 405B under their trn1 layouts is sharded on the
meta device (parallelize_model(..., shapes_only=True): nothing allocated) and what it would materialize is exactly
its shard, by arithmetic written out here independently of the parallel layers: its TP slices of its pipeline
stage's layers, replicated norms, a replicated KV head where tp exceeds the KV heads, and the embedding / output
head on the end stages. 8B and 70B take their layouts from the composed recipes (llama3/8b, llama3/70b on
pcluster_trn1); 405B has no recipe here and takes NxD Training's layout (tp 32 x pp 32; 126 layers are uneven over
32 stages)."""
from __future__ import annotations

import pytest

from launcher import cache
from runtime.models import meta_model
from runtime.models.init import meta_bytes
from runtime.parallel import ParallelDims, parallelize_model
from runtime.parallel.pipeline.stages import split_layers
from runtime.parallel.topology import Topology
from runtime.schema.model import ModelConfig

LLAMA3_VOCAB = 128256  # the Llama 3 tokenizer's size, a multiple of the recipes' make_vocab_size_divisible_by 128
LLAMA3_405B = dict(num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128,
                   num_query_groups=8, tp=32, pp=32)


def recipe(name: str) -> dict:
    training = cache.resolved([f"training={name}", "cluster=pcluster_trn1", "stages=[training]", "cluster_type=slurm",
                               "base_results_dir=/results", "data_dir=/data"])[0]["training"]
    model = training["model"]
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
    return {**{k: model[k] for k in keys}, "tp": model["tensor_model_parallel_size"],
            "pp": model["pipeline_model_parallel_size"]}


def expected_bytes(shape: dict, tp: int, layers: int, first: bool, last: bool) -> int:
    """fp32 bytes of one rank's shard, from the model's shape alone."""
    H, F, nh, ng, V = (shape["hidden_size"], shape["ffn_hidden_size"], shape["num_attention_heads"],
                       shape["num_query_groups"], LLAMA3_VOCAB)
    d = H // nh
    kv_rows = 2 * ng * d // tp if ng % tp == 0 else 2 * d  # tp > KV heads: one head, replicated
    per_layer = (nh * d // tp + kv_rows) * H + H * (nh * d // tp) + 2 * F // tp * H + H * F // tp + 2 * H
    total = layers * per_layer + (V // tp * H if first else 0) + (H + V // tp * H if last else 0)
    return 4 * total


@pytest.mark.parametrize("name", ["llama3/8b", "llama3/70b", "llama3_1/405b (NxD layout)"])
def test_a_rank_would_materialize_exactly_its_shard(name):
    shape = LLAMA3_405B if name.startswith("llama3_1/405b") else recipe(name)
    tp, pp = shape["tp"], shape["pp"]
    cfg = ModelConfig(architecture="llama", vocab_size=LLAMA3_VOCAB, max_position_embeddings=8192,
                      **{k: v for k, v in shape.items() if k not in ("tp", "pp")})
    dims = ParallelDims(tp=tp, pp=pp, dp=1, world_size=tp * pp)
    ranges = split_layers(cfg.num_layers, pp)
    whole = meta_bytes(meta_model(cfg))
    # The first stage's first TP rank, a middle stage's last and the last stage's last (each a meta build).
    for stage, tp_rank in sorted({(0, 0), (pp // 2, tp - 1), (pp - 1, tp - 1)}):
        rank = stage * tp + tp_rank  # rank_coords: tp fastest, then dp (1), then pp
        shard = parallelize_model(meta_model(cfg), Topology.offline(dims, rank), sequence_parallel=True,
                                  shapes_only=True)
        assert all(p.is_meta for p in shard.parameters())
        held = meta_bytes(shard)
        assert held == expected_bytes(shape, tp, len(ranges[stage]), stage == 0, stage == pp - 1), (name, rank)
        # About 1/(tp x pp) of the model (replicated KV heads and norms add a little; the end stages hold the
        # vocabulary's shards besides their layers), never the whole of it.
        ends = 2 * 4 * cfg.vocab_size * cfg.hidden_size // tp
        assert held <= 1.15 * whole / (tp * pp) + ends < whole, (name, rank)
