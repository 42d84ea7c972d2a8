"""A training continued in torchtitan from our converted checkpoint starts where ours goes on (issue 60, Done when):
our runtime trains a tiny Llama 3 shape (2 gloo ranks) to step N+1 saving at step N; `python -m runtime.convert
to-titan` turns step N into the torchtitan job's checkpoint folder; the job (rendered by launcher/titan_module.py,
2 ranks FSDP, on CPU with the FAKE accelerator of tests/titan/cpu_shim.py) resumes there and trains one step. Its
first-step loss equals our loss at step N+1 (fp32, <= 1e-5 relative): the same weights on the same global batch.

Both numbers are the mean token loss over the global batch: ours is runtime/objective.py's TokenMean (sum of
loss * loss_mask over every DP rank's micro-batches / their count; the mask is all ones here), torchtitan's is its
trainer's global_avg_loss (sum-reduced cross entropy over every rank / global_valid_tokens; no label is ignored).
The batch is the same one: torchtitan's dataloader (runtime/titan/data.py) reads our runtime's samples in our
order and resumes at the converted dataloader.consumed_samples. The loss is computed before the step's update, so
what the update would differ in (torchtitan's LR schedule and weight decay on every parameter) does not enter.
"""
import json

import pytest
import yaml

pytest.importorskip("torchtitan", reason="torchtitan is the optional extra nxdt-launch[torchtitan]")

from runtime.convert.__main__ import main as convert_main  # noqa: E402
from tests.titan.conftest import CONTEXT, SEQ_LEN, VOCAB, context, losses, run_titan, write_job  # noqa: E402

SAVED = 2  # N: our checkpoint's step; our step N+1 is torchtitan's first
SHAPE = CONTEXT["model"]
TRAINING = CONTEXT["training"]


def our_config(corpus, tmp_path) -> str:
    """conf/training/llama/tiny.yaml with the titan context's shape, data, seed, seq_len and batch (2 ranks, dp 2),
    trained to step N+1 and saving at step N."""
    from tests.runtime_train.helpers import build_tokenizer, reference_training_config

    tokenizer = tmp_path / "tokenizer.json"
    assert build_tokenizer(tokenizer, [f"w{i}" for i in range(VOCAB - 1)]) == VOCAB  # + <unk>
    raw = reference_training_config("llama", results_dir=tmp_path / "ours",
                                    data_prefix=[part for weight, prefix in corpus for part in (weight, prefix)],
                                    tokenizer=tokenizer)
    raw["trainer"].update(devices=2, max_steps=SAVED + 1, log_every_n_steps=1, val_check_interval=0,
                          limit_val_batches=0, preflight=False)
    raw["exp_manager"].update(create_tensorboard_logger=False, create_metrics_plot=False)
    raw["exp_manager"]["checkpoint_callback_params"].update(every_n_train_steps=SAVED, save_top_k=-1,
                                                            async_save=False)
    raw["precision"]["type"] = "fp32"
    raw["model"].update(
        encoder_seq_length=SEQ_LEN, max_position_embeddings=SEQ_LEN, num_layers=SHAPE["n_layers"],
        hidden_size=SHAPE["dim"], ffn_hidden_size=SHAPE["hidden_dim"], num_attention_heads=SHAPE["n_heads"],
        num_query_groups=SHAPE["n_kv_heads"], rotary_base=SHAPE["rope_theta"], layernorm_epsilon=SHAPE["norm_eps"],
        share_embeddings_and_output_weights=SHAPE["tie_embeddings"], make_vocab_size_divisible_by=1,
        micro_batch_size=TRAINING["local_batch_size"], global_batch_size=TRAINING["global_batch_size"],
        seed=TRAINING["seed"])
    optimizer = CONTEXT["optimizer"]
    raw["model"]["optim"].update(lr=optimizer["lr"], weight_decay=optimizer["weight_decay"], eps=optimizer["eps"],
                                 betas=[optimizer["beta1"], optimizer["beta2"]])
    raw["model"]["optim"]["sched"].update(warmup_steps=CONTEXT["lr_scheduler"]["warmup_steps"],
                                          min_lr=optimizer["lr"] * CONTEXT["lr_scheduler"]["min_lr_factor"])
    raw["model"]["data"].update(seq_length=SEQ_LEN, splits_string=CONTEXT["data"]["splits_string"],
                                index_mapping_dir=str(tmp_path / "index"))
    path = tmp_path / "ours.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def our_losses(results) -> dict[int, float]:
    rows = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_first_step_loss_from_our_converted_checkpoint_equals_ours(corpus, tmp_path):
    from tests.checkpoint.launch_helpers import train_here
    from tests.runtime_parallel.dist_utils import run_distributed

    assert run_distributed(train_here, 2, args=(our_config(corpus, tmp_path), "training")) == [0, 0]
    ours = our_losses(tmp_path / "ours")
    assert sorted(ours) == [1, 2, SAVED + 1]
    saved = [p for p in (tmp_path / "ours" / "checkpoints").iterdir() if p.name.startswith(f"step_{SAVED:08d}")]
    assert len(saved) == 1, sorted(p.name for p in (tmp_path / "ours" / "checkpoints").iterdir())

    # torchtitan resumes from <dump_folder>/<checkpoint.folder>/step-N: model, AdamW moments, LR schedule, step and
    # the data position (consumed_samples = N x global batch), and trains its step N+1 only.
    titan = tmp_path / "titan"
    assert convert_main(["to-titan", "--checkpoint", str(saved[0]), "--folder", str(titan / "checkpoint")]) == 0
    ctx = context(corpus, titan, parallelism={"data_parallel_shard_degree": 2}, training={"steps": SAVED + 1},
                  checkpoint={"enable": True, "interval": 100, "keep_latest_k": 0})
    run_titan(write_job(ctx, tmp_path / "titan.py"), 2)
    theirs = losses(titan)
    assert sorted(theirs) == [SAVED + 1], theirs
    # Our losses move by ~1e-2 a step here, so 1e-5 tells this batch on these weights from any other.
    assert theirs[SAVED + 1] == pytest.approx(ours[SAVED + 1], rel=1e-5, abs=0), (theirs, ours)
