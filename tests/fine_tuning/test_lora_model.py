"""LoRA on the plain model (runtime/models/lora.py), single process: what the adapters add, what stays frozen,
what the optimizer holds, and that merging reproduces the adapted model. The layouts' exactness is in
tests/runtime_parallel and tests/runtime_pipeline (jobs named *-lora-*)."""
from __future__ import annotations

import pytest
import torch

from runtime.models import build_model
from runtime.models.lora import LoRA, apply_lora, merge_lora, projection_segments
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import LoraConfig
from runtime.step import train_step

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config(arch: str) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=16,
                       share_embeddings_and_output_weights=arch == "gpt")


def lora(arch: str, targets=ALL, rank: int = 4) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=8.0, dropout=0.0,
                      target_modules=tuple(t for t in targets if arch == "llama" or t != "gate_proj"))


def random_adapters(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_adapters_start_as_the_base_model_and_only_they_train(arch):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    base = build_model(config(arch))
    expected = base(ids)
    model = apply_lora(build_model(config(arch)), lora(arch), seed=1)
    assert torch.equal(model(ids), expected), "B starts at zero: the adapted model starts as the base model"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)
    # One A and one B per adapted target per layer, named by Hugging Face projection.
    targets = lora(arch).target_modules
    assert len(trainable) == 2 * len(targets) * config(arch).num_layers
    assert "layers.1.attn.qkv.lora.B.v_proj" in trainable
    # The base keeps its names: a checkpoint or export of the base reads the same keys.
    assert {n for n, _ in model.named_parameters() if ".lora." not in n} == {n for n, _ in base.named_parameters()}


def test_segments_follow_the_fused_projections():
    segments = projection_segments(config("llama"))
    assert segments["attn.qkv"] == [("q_proj", 32), ("k_proj", 16), ("v_proj", 16)]
    assert segments["mlp.gate_up"] == [("gate_proj", 48), ("up_proj", 48)]
    adapted = apply_lora(build_model(config("llama")), lora("llama", ("k_proj",)), seed=0)
    qkv = adapted.layers[0].attn.qkv.lora
    assert isinstance(qkv, LoRA) and list(qkv.B) == ["k_proj"] and qkv.B["k_proj"].shape == (16, 4)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_merged_weights_compute_what_the_adapted_model_does(arch):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    model = apply_lora(build_model(config(arch)), lora(arch), seed=3)
    random_adapters(model)
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}  # a tied head too
    merged = build_model(config(arch))
    merged.load_state_dict(merge_lora(state, config(arch), lora(arch).scale), strict=True)
    torch.testing.assert_close(merged(ids), model(ids), rtol=0, atol=1e-5)
    assert not torch.allclose(build_model(config(arch))(ids), model(ids), atol=1e-3), "the adapters do something"


@pytest.mark.parametrize("precision", ["fp32", "bf16SR", "mixed_precision", "autocast"])
def test_base_weights_stay_bitwise_and_the_optimizer_holds_adapters_only(precision):
    cfg = config("llama")
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    model = apply_lora(build_model(cfg), lora("llama"), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = parallelize_model(model, topo, data_parallel=DataParallelConfig(precision))
    optimizer = ShardedAdamW(model, {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8})
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        train_step(model, optimizer, [(ids, ids.roll(-1, 1), None)], topo, lr=1e-2, clip=1.0)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)
    moments = sum(m.numel() for m in optimizer.exp_avg) + sum(v.numel() for v in optimizer.exp_avg_sq)
    assert moments == 2 * adapters, "Adam moments for the adapters, none for the frozen base"
    dtype = torch.bfloat16 if precision in ("bf16SR", "mixed_precision") else torch.float32
    for name, param in model.named_parameters():
        if ".lora." in name:
            assert not torch.equal(param.float(), before[name]), f"{name} did not train"
        else:
            assert param.dtype == dtype, f"{name} is {param.dtype}, not the precision's {dtype}"
            assert torch.equal(param, before[name].to(dtype)), f"frozen {name} changed"
