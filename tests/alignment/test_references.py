"""Reference log-probabilities: the table computed once before training equals the frozen model scoring the same
batches on the fly (single process, and assembled over two DP ranks); with LoRA the base with its adapters off is
the model before the adapters; the cache is reused, and a damaged one is recomputed, never used."""
from __future__ import annotations

import contextlib

import pytest
import torch

from runtime.alignment.data import build_preference_dataset
from runtime.alignment.reference import live_scorer, reference_key, reference_table, score_batch
from runtime.alignment.synthetic import write_demo
from runtime.data import DataParallelBatches
from runtime.micro_batch import PreparedBatch
from runtime.models import ModelConfig, build_model
from runtime.models.lora import apply_lora
from runtime.parallel import ParallelDims, Topology, parallelize_model
from runtime.schema.training_config import LoraConfig
from tests.runtime_parallel.dist_utils import run_distributed

SEQ, MICRO = 64, 4
CFG = dict(architecture="llama", vocab_size=512, hidden_size=32, num_layers=2, num_attention_heads=4,
           num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=SEQ)
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    directory = tmp_path_factory.mktemp("preference_demo")
    write_demo(directory, num_train=40, num_valid=8, num_test=8, seed=3)
    return directory


def _dataset(demo, cache):
    return build_preference_dataset([demo / "train.jsonl"], demo, SEQ, max_prompt_length=32, cache_dir=cache)


def _model(topo: Topology):
    return parallelize_model(build_model(ModelConfig(**CFG)), topo)


def _table(model, dataset, topo, key="k"):
    return reference_table(model, dataset, topo, micro_batch_size=MICRO, device=torch.device("cpu"), model_key=key,
                           autocast=contextlib.nullcontext, is_writer=topo.rank == 0, barrier=lambda: None)


def _solo():
    return Topology.build(ParallelDims(1, 1, 1, 1))


def test_precomputed_references_equal_the_frozen_model_on_the_fly(demo, tmp_path, single_thread):
    topo = _solo()
    model = _model(topo)
    dataset = _dataset(demo, tmp_path)
    table = _table(model, dataset, topo)
    assert table.shape == (len(dataset), 2) and bool((table < 0).all())
    # The training loader's batches (shuffled pairs, chosen rows then rejected) scored as a step would score them.
    from runtime.sft.dataset import epoch_samples

    batches = DataParallelBatches(epoch_samples(dataset, 3 * 8, seed=5), global_batch_size=8, micro_batch_size=MICRO)
    for _ in range(3):
        for input_ids, labels, mask, _, pair_ids in batches.next_batch():
            on_the_fly = score_batch(model, PreparedBatch(input_ids, labels, mask), topo, contextlib.nullcontext)
            expected = torch.cat([table[pair_ids, 0], table[pair_ids, 1]])
            torch.testing.assert_close(on_the_fly, expected, rtol=1e-6, atol=0)


def test_the_cache_is_reused_and_a_damaged_one_recomputed(demo, tmp_path, single_thread, capsys):
    topo = _solo()
    model, dataset = _model(topo), _dataset(demo, tmp_path)
    first = _table(model, dataset, topo)
    assert "scored by the starting model" in capsys.readouterr().out
    cached = tmp_path / f"ref_{dataset.cache_key}_k.npy"
    assert cached.is_file()
    # Another model with the same key would be wrong to score: the cache is what is read.
    other = parallelize_model(build_model(ModelConfig(**{**CFG, "seed": 99})), topo)
    assert torch.equal(_table(other, dataset, topo), first)
    assert "scored" not in capsys.readouterr().out
    cached.write_bytes(cached.read_bytes()[:-8] + b"\0" * 8)
    again = _table(model, dataset, topo)
    captured = capsys.readouterr()
    assert str(cached) in captured.err and "recomputing" in captured.err
    assert torch.equal(again, first)


def test_the_key_names_the_starting_weights(tmp_path):
    cfg = ModelConfig(**CFG)
    base = reference_key(None, cfg, 1234, "fp32", False)
    assert reference_key(None, cfg, 1, "fp32", False) != base  # a random init's seed
    assert reference_key(None, cfg, 1234, "bf16SR", False) != base
    weights = tmp_path / "hf"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"x")
    before = reference_key(str(weights), cfg, 1234, "fp32", False)
    assert reference_key(str(weights), cfg, 7, "fp32", False) == before  # restored weights: the seed is moot
    (weights / "model.safetensors").write_bytes(b"xy")
    assert reference_key(str(weights), cfg, 1234, "fp32", False) != before


def test_lora_base_with_adapters_off_is_the_model_before_the_adapters(demo, tmp_path, single_thread):
    topo = _solo()
    dataset = _dataset(demo, tmp_path)
    plain = build_model(ModelConfig(**CFG))
    adapted = build_model(ModelConfig(**CFG))
    apply_lora(adapted, LORA, seed=1)
    with torch.no_grad():  # adapters that act: B non-zero
        for name, param in adapted.named_parameters():
            if ".lora.B." in name:
                param.normal_(0, 0.5)
    plain, adapted = parallelize_model(plain, topo), parallelize_model(adapted, topo)
    batch = DataParallelBatches(dataset, global_batch_size=MICRO, micro_batch_size=MICRO).next_batch()[0].prepare()
    live = live_scorer(topo, contextlib.nullcontext)(adapted, batch)
    assert torch.equal(live, score_batch(plain, batch, topo, contextlib.nullcontext))
    assert not torch.equal(live, score_batch(adapted, batch, topo, contextlib.nullcontext))


def _two_rank_table(directory: str, cache: str) -> torch.Tensor:
    from pathlib import Path

    torch.manual_seed(0)
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=2, world_size=2))
    dataset = _dataset(Path(directory), Path(cache))
    model = _model(topo)
    return reference_table(model, dataset, topo, micro_batch_size=3, device=torch.device("cpu"), model_key="dp2",
                           autocast=contextlib.nullcontext, is_writer=topo.rank == 0, barrier=lambda: None)


def test_two_data_parallel_ranks_assemble_the_same_table(demo, tmp_path, single_thread):
    """Each DP rank scores its share (40 pairs in micro-batches of 3: the second rank pads its last one) and the
    shares are summed over DP: every rank holds the single-process table."""
    tables = run_distributed(_two_rank_table, 2, args=(str(demo), str(tmp_path / "dp")))
    single = _table(_model(_solo()), _dataset(demo, tmp_path / "solo"), _solo())
    for table in tables:
        torch.testing.assert_close(table, single, rtol=1e-6, atol=0)


def test_the_neuron_compile_step_caches_nothing(demo, tmp_path, single_thread, monkeypatch):
    monkeypatch.setenv("NXDT_COMPILE", "1")
    topo = _solo()
    dataset = _dataset(demo, tmp_path)
    table = _table(_model(topo), dataset, topo)
    assert not torch.count_nonzero(table) and not list(tmp_path.glob("ref_*"))

