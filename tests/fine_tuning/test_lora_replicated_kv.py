"""LoRA on k and v where tensor parallelism exceeds the KV heads (NxD Training's kv_replicator: its Llama 3 8B LoRA
example adapts q, k and v at TP 32 over 8 KV heads). Each rank holds a copy of its query heads' KV head, and of
that head's rows of B_k and B_v: one adapter per real KV head, whose copies' gradients are summed like the base
head's. A tiny Llama (2 KV heads) at tp 4 with sequence parallelism, four gloo processes: every step's loss
equals the one-process run's (fp32, 1e-5), the copies of a head's adapter stay bitwise one, and the checkpoint
they save exports (merged Hugging Face model, base and PEFT adapter) to the one-process run's export."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from runtime.checkpoint import Checkpointer, write_full_checkpoint
from runtime.convert.__main__ import main
from runtime.models.lora import is_adapter
from runtime.parallel import DataParallelConfig, ShardedAdamW, gather_full_state_dict, parallelize_model
from runtime.schema.rules import padded_vocab_size
from runtime.step import train_step
from tests.convert.test_hf import _tokenizer
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.dist_utils import run_distributed

LAYOUT = H.Layout(tp=4, sequence_parallel=True)  # 4 query heads over 2 KV heads: each KV head on 2 ranks
STEPS = 3
PEFT = {"peft_scheme": "lora", "lora_rank": H.LORA.rank, "lora_alpha": H.LORA.alpha, "lora_dropout": 0.0,
        "target_modules": list(H.LORA.target_modules)}


def _model_keys(tokenizer: str) -> dict:
    """The `model:` section a LoRA run of the harness's tiny Llama records (its base: the seed's random init)."""
    return {**{k: v for k, v in H.TINY["llama"].items() if k != "vocab_size"}, "encoder_seq_length": H.SEQ,
            "make_vocab_size_divisible_by": 128, "tokenizer": {"library": "huggingface", "model": tokenizer},
            "peft": PEFT, "restore_from_path": None}


def _train_and_save(cfg, directory: str, config: dict) -> dict:
    """In each rank: the harness's LoRA run (adapters on all seven projections, B drawn non-zero) under LAYOUT,
    STEPS steps, then a checkpoint as training saves it."""
    topo = H.make_topology(LAYOUT)
    model = parallelize_model(H.fine_tuning_model(cfg, "lora"), topo, sequence_parallel=True,
                              data_parallel=DataParallelConfig("fp32", bucket_numel=H.BUCKET_NUMEL))
    optimizer = ShardedAdamW(model, H.OPTIM)
    losses = [train_step(model, optimizer, H.step_inputs("lora", step, cfg.vocab_size, topo)[0], topo,
                         lr=H.OPTIM["lr"], clip=1.0).loss for step in range(STEPS)]
    Checkpointer(directory, rank=dist.get_rank(), world_size=dist.get_world_size(), token="0",
                 async_save=False).save(STEPS, model, optimizer, topo, extra={"step": STEPS}, config=config)
    dist.barrier()  # rank 0 committed
    heads = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("B.k_proj", "B.v_proj"))}
    return {"losses": losses, "heads": heads, "kv_slot": model.layers[0].attn.qkv.kv_slot,
            "state": gather_full_state_dict(model, topo)}


def _export(tmp_path, checkpoint: str, name: str) -> dict[str, dict[str, torch.Tensor]]:
    """The conversion stage's export of `checkpoint` with conversion.lora=both: every safetensors file it wrote."""
    out = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"mode": "export", "checkpoint_dir": checkpoint, "output_dir": str(out),
                                      "lora": "both"}))
    assert main(["--config", str(config)]) == 0
    return {str(path.relative_to(out)): load_file(path) for path in sorted(out.rglob("*.safetensors"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lora_kv")
    tokenizer = tmp_path / "tokenizer.json"
    cfg = H.tiny_config("llama", vocab_size=padded_vocab_size(_tokenizer(tokenizer, ("<s>", "</s>")), 128))
    config = {"model": _model_keys(str(tokenizer))}
    ranks = run_distributed(_train_and_save, 4, args=(cfg, str(tmp_path / "tp4"), config))
    reference = H.train(cfg, H.Layout(), steps=STEPS, fine_tuning="lora")
    trained = {n: t for n, t in reference["state"].items() if is_adapter(n)}
    write_full_checkpoint(str(tmp_path / "one"), STEPS, trained, config=config)
    return dict(tmp_path=tmp_path, cfg=cfg, ranks=ranks, reference=reference)


def test_each_step_equals_the_one_process_run_and_the_copies_stay_one(runs):
    reference, ranks = runs["reference"], runs["ranks"]
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for name, want in reference["state"].items():
            torch.testing.assert_close(rank["state"][name], want, rtol=0, atol=1e-5, msg=name)
    assert [rank["kv_slot"] for rank in ranks] == [0, 0, 1, 1]
    d = runs["cfg"].head_dim
    for first, second in (ranks[0:2], ranks[2:4]):  # the two copies of one KV head
        for name, rows in first["heads"].items():
            assert rows.shape == (d, H.LORA.rank), name  # one head's rows of B
            assert torch.equal(rows, second["heads"][name]), f"{name}: the copies of a head's adapter drifted"
    H.assert_learns(reference)  # the adapters, k's and v's among them, moved; the base did not


def test_the_checkpoint_exports_the_real_heads_adapters(runs):
    tmp_path = runs["tmp_path"]
    got = _export(tmp_path, str(tmp_path / "tp4"), "tp4_export")
    want = _export(tmp_path, str(tmp_path / "one"), "one_export")
    assert set(got) == set(want) and "adapter/adapter_model.safetensors" in got, sorted(got)
    for file, tensors in want.items():
        assert got[file].keys() == tensors.keys(), file
        for name, tensor in tensors.items():
            torch.testing.assert_close(got[file][name], tensor, rtol=0, atol=1e-5, msg=f"{file}: {name}")
    cfg = runs["cfg"]
    adapter = got["adapter/adapter_model.safetensors"]
    k = adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert k.shape == (cfg.kv_heads * cfg.head_dim, H.LORA.rank), "B_k of the 2 real heads, not of 4 copies"
