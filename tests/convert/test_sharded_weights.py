"""Starting weights read by slices, and exports written tensor by tensor.

- A rank of any layout that loads a Hugging Face directory of sharded safetensors (model.safetensors.index.json)
  through hf.SlicedReader holds bitwise the rows of the whole model read the old way (load_hf_directory), for a
  Llama with grouped-query attention (fused QKV and gate/up built from slices; replicated KV heads at tp=4), a GPT-2
  (Conv1D's transposed storage, tied embedding across pipeline stages) and a Mixtral (experts under EP and TP).
- A checkpoint of ours as the starting point is read by byte ranges, each rank its own selection.
- save_hf_directory's own writer produces files safetensors reads as the same tensors save_file would write, and
  an index like transformers' when the model spans several files.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.checkpoint import write_full_checkpoint
from runtime.convert.hf import load_hf_directory, save_hf_directory, to_hf
from runtime.finetune import load_pretrained
from runtime.models import build_model, meta_model
from runtime.parallel import ParallelDims, parallelize_model
from runtime.parallel.topology import Topology
from runtime.schema.model import ModelConfig, MoEConfig

SMALL_SHARDS = 40_000  # bytes: each of these models spans several files


def config(arch: str, **overrides) -> ModelConfig:
    keys = dict(architecture=arch, vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                ffn_hidden_size=48, max_position_embeddings=32, seed=3,
                share_embeddings_and_output_weights=arch == "gpt")
    return ModelConfig(**{**keys, **overrides})


CASES = {
    "llama gqa tp2": (config("llama", num_query_groups=2), dict(tp=2)),
    "llama replicated kv tp4": (config("llama", num_query_groups=2), dict(tp=4)),
    "gpt tp2 pp2 tied": (config("gpt"), dict(tp=2, pp=2)),
    "mixtral ep2 tp2": (config("llama", num_query_groups=2, moe=MoEConfig(num_experts=4, top_k=2)),
                        dict(tp=2, ep=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_reads_its_own_slices_of_sharded_safetensors(tmp_path, name):
    cfg, layout = CASES[name]
    source = build_model(cfg)
    with torch.no_grad():  # weights unlike the init, so a load that did nothing would show
        for param in source.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    directory = save_hf_directory(tmp_path / "hf", source.state_dict(), cfg, None, max_shard_bytes=SMALL_SHARDS)
    assert (directory / "model.safetensors.index.json").is_file()
    whole, _, _ = load_hf_directory(directory)
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    dims = ParallelDims(tp=tp, pp=pp, dp=ep, world_size=tp * pp * ep, ep=ep)
    for rank in range(dims.world_size):
        stage = parallelize_model(meta_model(cfg), Topology.offline(dims, rank),
                                  starting_weights=lambda model, plan: load_pretrained(model, str(directory), plan))
        plan = stage.sharding_plan
        for local, param in stage.named_parameters(remove_duplicate=False):
            full = plan.full_name(local)
            expected = whole["embed.word.weight" if full == "output.weight" and cfg.share_embeddings_and_output_weights
                             else full]
            for dim, index in sorted(plan.selection(local).items()):
                expected = expected.index_select(dim, index)
            assert torch.equal(param, expected), f"{name} rank {rank}: {local}"


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_the_streamed_writer_writes_what_safetensors_would(tmp_path, arch):
    cfg = config(arch, num_query_groups=2 if arch == "llama" else None)
    state = {k: v.to(torch.bfloat16) for k, v in build_model(cfg).state_dict().items()}
    ours = save_hf_directory(tmp_path / "ours", state, cfg, None, max_shard_bytes=SMALL_SHARDS // 4)
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    reference, _ = to_hf(state, cfg)
    assert set(index["weight_map"]) == set(reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    save_file(reference, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    with safe_open(str(tmp_path / "reference.safetensors"), "pt") as expected:
        for name, file in index["weight_map"].items():
            with safe_open(str(ours / file), "pt") as found:
                assert found.metadata() == expected.metadata() == {"format": "pt"}
                assert torch.equal(found.get_tensor(name), expected.get_tensor(name)), name
                assert found.get_tensor(name).dtype == torch.bfloat16
    again, _, _ = load_hf_directory(ours)
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_each_rank_reads_its_byte_ranges_of_a_checkpoint_of_ours(tmp_path):
    """model.restore_from_path at a checkpoint of ours (format 2, read by ranges as a resume reads it)."""
    cfg, layout = CASES["llama replicated kv tp4"]
    source = build_model(config("llama", num_query_groups=2, seed=9))
    location = write_full_checkpoint(str(tmp_path / "ckpt"), 3, dict(source.named_parameters()),
                                     config={"model": {"architecture": "llama"}})
    whole = dict(source.named_parameters())
    dims = ParallelDims(tp=4, pp=1, dp=1, world_size=4)
    for rank in range(4):
        stage = parallelize_model(meta_model(cfg), Topology.offline(dims, rank),
                                  starting_weights=lambda model, plan: load_pretrained(model, location, plan))
        plan = stage.sharding_plan
        for local, param in stage.named_parameters():
            expected = whole[plan.full_name(local)]
            for dim, index in sorted(plan.selection(local).items()):
                expected = expected.index_select(dim, index)
            assert torch.equal(param, expected), f"rank {rank}: {local}"
