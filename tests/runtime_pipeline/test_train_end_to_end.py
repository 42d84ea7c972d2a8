# The training entry point with pipeline parallelism: 2 CPU processes, pp=2 x vpp=2 (interleaved 1F1B, forward-only
# interleaved validation), against the single-process run on the same data and config. Both are runtime.train's own
# main() in ranks forked from this process (tests/checkpoint/launch_helpers.train_here): what is under test is the
# pipelined run's numbers; starting under torchrun is tests/runtime_train/test_train_end_to_end.py's.
import json

import numpy as np
import pytest
import yaml

from tests.runtime_train.helpers import build_tokenizer, reference_training_config, write_mmidx

NUM_WORDS = 64


def _config(root, *, devices, pp, vpp, name):
    raw = reference_training_config("gpt", results_dir=root / name, data_prefix=str(root / "corpus"),
                                    tokenizer=root / "tokenizer.json")
    raw["trainer"].update(devices=devices, max_steps=6, log_every_n_steps=1, val_check_interval=3,
                          limit_val_batches=1)
    # No TensorBoard events and no metrics.png: importing tensorboard and matplotlib in each forked rank and drawing
    # cost more CPU than the training itself; the numbers compared are metrics.jsonl's.
    raw["exp_manager"].update(create_tensorboard_logger=False, create_metrics_plot=False)
    model = raw["model"]
    model.update(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                 encoder_seq_length=16, max_position_embeddings=16, num_layers=4, hidden_size=32,
                 ffn_hidden_size=64, num_attention_heads=4, micro_batch_size=2, global_batch_size=8,
                 make_vocab_size_divisible_by=16)
    model["data"].update(seq_length=16, splits_string="90,5,5", index_mapping_dir=str(root / "index"))
    model["optim"]["lr"] = 1e-3
    model["optim"]["sched"].update(warmup_steps=2, min_lr=1e-4)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(config, nproc) -> None:
    from tests.checkpoint.launch_helpers import train_here
    from tests.runtime_parallel.dist_utils import run_distributed

    assert run_distributed(train_here, nproc, args=(str(config), "training")) == [0] * nproc


def _records(results):
    records = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


@pytest.mark.slow
def test_pp2_vpp2_run_matches_single_process(tmp_path):
    build_tokenizer(tmp_path / "tokenizer.json", [f"w{i}" for i in range(NUM_WORDS)])
    rng = np.random.default_rng(0)
    docs = [(rng.integers(NUM_WORDS) + rng.choice((1, 3)) * np.arange(rng.integers(40, 90))) % NUM_WORDS + 1
            for _ in range(120)]
    write_mmidx(tmp_path / "corpus", docs)
    _run(_config(tmp_path, devices=1, pp=1, vpp=None, name="single"), nproc=1)
    _run(_config(tmp_path, devices=2, pp=2, vpp=2, name="pp2_vpp2"), nproc=2)
    (train_a, val_a), (train_b, val_b) = _records(tmp_path / "single"), _records(tmp_path / "pp2_vpp2")
    assert [r["step"] for r in train_a] == [r["step"] for r in train_b] == list(range(1, 7))
    for a, b in zip(train_a, train_b):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert [r["step"] for r in val_b] == [3, 6]
    for a, b in zip(val_a, val_b):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
