"""Shard-only initialization (runtime/models/init.py): a rank that builds the model on the meta device and
materializes only its own part holds bitwise the values of the one-process model at its selection, for every kind
of layout (TP with fused QKV and gate/up, replicated KV heads, pipeline stages with a tied embedding, experts with
TP inside them, LoRA adapters); and it allocates nothing but its part. Every rank of each layout is checked in this
one process: the layers are built from Topology.offline (coordinates, no process groups), since sharding and
materializing need no collective."""
from __future__ import annotations

import pytest
import torch

from runtime.models import build_model, meta_model
from runtime.models.init import TILE, Init, meta_bytes, values
from runtime.models.lora import apply_lora
from runtime.parallel import ParallelDims, parallelize_model
from runtime.parallel.parallelize import apply_tensor_parallel
from runtime.parallel.topology import Topology
from runtime.schema.model import ModelConfig
from runtime.schema.model import MoEConfig
from runtime.schema.training_config import LoraConfig

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))


def config(arch: str, **overrides) -> ModelConfig:
    # Sizes over one tile (TILE rows) so that shards meet tiles partly, and odd sizes for partial tiles.
    keys = dict(architecture=arch, vocab_size=384, hidden_size=160, num_layers=4, num_attention_heads=8,
                ffn_hidden_size=288, max_position_embeddings=64, seed=11,
                share_embeddings_and_output_weights=arch == "gpt")
    return ModelConfig(**{**keys, **overrides})


LAYOUTS = {
    "llama tp4 (replicated KV: 2 heads)": (config("llama", num_query_groups=2), dict(tp=4)),
    "llama tp2 pp2 vpp2, lora": (config("llama", num_query_groups=4), dict(tp=2, pp=2, vpp=2, lora=True)),
    "llama tp4 lora (v adapter of replicated KV heads)": (config("llama", num_query_groups=2), dict(tp=4, lora=True)),
    "gpt tp2 pp2 (tied embedding on both ends)": (config("gpt"), dict(tp=2, pp=2)),
    "gpt tp4 lora (row-parallel A)": (config("gpt"), dict(tp=4, lora=True)),
    "moe ep2 tp2": (config("llama", num_query_groups=4, moe=MoEConfig(num_experts=4, top_k=2)),
                    dict(tp=2, ep=2)),
}


def ranks(layout: dict):
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    dims = ParallelDims(tp=tp, pp=pp, dp=ep, world_size=tp * pp * ep, ep=ep)
    return [Topology.offline(dims, rank) for rank in range(dims.world_size)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rank_materializes_the_one_process_values(name):
    cfg, layout = LAYOUTS[name]
    full = build_model(cfg)
    if layout.get("lora"):
        apply_lora(full, LORA, seed=5)
    whole = dict(full.named_parameters(remove_duplicate=False))
    for topo in ranks(layout):
        model = meta_model(cfg)
        if layout.get("lora"):
            apply_lora(model, LORA, seed=5)
        planned = None

        def count(stage, plan):
            nonlocal planned
            planned = sum(p.numel() * 4 for p in {id(p): p for p in stage.parameters()}.values())

        stage = parallelize_model(model, topo, sequence_parallel=True, virtual_pp=layout.get("vpp"),
                                  starting_weights=count)
        plan = stage.sharding_plan
        seen = 0
        for local, param in stage.named_parameters(remove_duplicate=False):
            assert not param.is_meta, local
            reference = whole[plan.full_name(local)]
            for dim, index in sorted(plan.selection(local).items()):
                reference = reference.index_select(dim, index)
            assert torch.equal(param, reference), f"{name}, {topo}: {local}"
            seen += 1
        assert seen and planned == sum(p.numel() * 4 for p in {id(p): p for p in stage.parameters()}.values())
        assert not any(b.is_meta for b in stage.buffers())


def test_a_rank_allocates_only_its_part():
    """What a tp=4 rank of the meta model would materialize is a quarter of the sharded weights, not the model."""
    cfg = config("llama", num_query_groups=4, num_layers=2)
    total = meta_bytes(meta_model(cfg))
    model = meta_model(cfg)
    apply_tensor_parallel(model, ranks(dict(tp=4))[1].tp, sequence_parallel=False)  # shapes only, no values
    norms = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)
    assert meta_bytes(model) == (total - norms) // 4 + norms


def test_values_are_defined_by_tiles_not_by_the_draw():
    """A selection's values are the full tensor's at those indices, whatever indices: rows, columns, experts."""
    init, shape = Init("normal", 0.02), (3, 2 * TILE + 5, TILE + 7)
    whole = values(init, "w", 1, shape)
    rows, cols = torch.tensor([0, 5, TILE, 2 * TILE + 4]), torch.tensor([1, 3, TILE - 1, TILE + 2, TILE + 4])
    picked = values(init, "w", 1, shape, {0: torch.tensor([2, 0]), 1: rows, 2: cols})
    assert torch.equal(picked, whole[[2, 0]][:, rows][:, :, cols])
    runs = values(init, "w", 1, shape, {2: torch.arange(TILE - 3, TILE + 7)})  # a run across two tiles
    assert torch.equal(runs, whole[:, :, TILE - 3:TILE + 7])
    assert not torch.equal(values(init, "w", 2, shape), whole)  # the seed matters
    assert not torch.equal(values(init, "v", 1, shape), whole)  # so does the name
    assert abs(float(whole.std()) - 0.02) < 1e-3
