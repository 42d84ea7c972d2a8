"""The estimator against peak memory measured from the real runtime on CPU, for small models.

Each config is composed by the launcher (as a launch would), written as the training stage's YAML, and trained
for 2 steps by runtime.train's own train() in one process (gloo, world size 1) under torch's profiler; see
measure_memory.py for what exactly is measured: the peak of live tensor bytes during the steps, which excludes
the Python/torch baseline of the process that its resident-set size would include. The estimate compared is the
same quantity (StageMemory.total: weights + gradients + optimizer + activations + loss working set), without
the per-process overhead the fit check adds on CPU.

Two steps, because the peak is taken over step 2 (the first step that starts with every persistent tensor in
place: weights, gradient buffers, Adam's moments); a third step repeats step 2's allocations exactly (the same
peak to the byte in every case here) at the price of another step of bf16 matmuls, which dominate the time. One
micro-batch per step (global batch = micro-batch), for the same reason: without pipeline parallelism the peak is one
micro-batch's activations on top of the persistent tensors, which a second or fourth micro-batch of the same step
repeats (measured: the same peaks to 0.1 MiB with 4 micro-batches per step, at 2.6 times the time)."""

import contextlib
import json
import multiprocessing

import pytest
import torch.distributed as dist

from launcher import launch
from launcher.estimator import estimate
from tests.estimate import measure_memory
from tests.estimate.demo_data import demo_shaped_data

SHORT_RUN = ["stages=[training]", "cluster_type=local", "training.trainer.num_nodes=1", "training.trainer.devices=1",
             "training.trainer.max_steps=2", "training.trainer.log_every_n_steps=1",
             "training.model.global_batch_size=${training.model.micro_batch_size}",
             "training.trainer.val_check_interval=0", "training.model.optim.sched.warmup_steps=1",
             "training.exp_manager.create_tensorboard_logger=false"]

# (name, overrides): both architectures, every precision family, each recompute mode, batch and width changes. The
# bf16 cases run a micro-batch of 2 (the recipe's is 4): a bf16 matmul costs ~45x an fp32 one here (measure_memory.py),
# and these cases are about the precision's bytes; how the peak grows with the batch is the fp32 cases' (4 and 8).
BF16_BATCH = "training.model.micro_batch_size=2"
CASES = [
    ("gpt fp32", ["training=gpt3/tiny"]),
    ("llama mixed_precision", ["training=llama/tiny", "training.precision.type=mixed_precision", BF16_BATCH]),
    ("llama bf16SR, selective attention+mlp", ["training=llama/tiny", "training.precision.type=bf16SR",
                                               "training.model.activations_checkpoint_granularity=selective",
                                               "training.model.activations_checkpoint_recompute=[core_attention,mlp]",
                                               BF16_BATCH]),
    ("gpt autocast, full recompute, wider", ["training=gpt3/tiny", "training.precision.type=autocast",
                                             "training.model.activations_checkpoint_granularity=full",
                                             "training.model.hidden_size=256", "training.model.num_attention_heads=8",
                                             BF16_BATCH]),
    ("gpt fp32, dropout, micro-batch 8", ["training=gpt3/tiny", "training.model.hidden_dropout=0.1",
                                          "training.model.attention_dropout=0.1",
                                          "training.model.micro_batch_size=8"]),
]


def _measure(configs: list[str], out: str) -> None:
    with open(out, "w") as stream, contextlib.redirect_stdout(stream):
        measure_memory.main(configs)


@pytest.mark.long("profiles real training steps of every case the estimator is checked against")
def test_estimated_peak_memory_is_within_15_percent_of_measured(tmp_path):
    data_dir = demo_shaped_data(tmp_path / "data")
    configs, expected = [], {}
    for index, (name, overrides) in enumerate(CASES):
        plan = launch.make_plan([*overrides, *SHORT_RUN, f"data_dir={data_dir}",
                                 f"base_results_dir={tmp_path}", f"run_name=case{index}"],
                                dry_run=True, produced_by="test")
        launch.write(plan)
        path = str(plan.jobs[0].config_path)
        configs.append(path)
        expected[path] = (name, estimate(plan.cfg["training"], device="cpu"))

    # measure_memory.py's main in a process forked from this one, where torch and the runtime are already imported
    # (a fresh interpreter would import them again): the process is the script's own (its one-process group, its
    # profiler), a copy of this one in all else. Its traceback, if any, goes to this test's stderr.
    assert not dist.is_initialized(), "a forked process would inherit this process's group"
    out = tmp_path / "measured.jsonl"
    child = multiprocessing.get_context("fork").Process(target=_measure, args=(configs, str(out)))
    child.start()
    child.join(timeout=300)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"measure_memory.py ended with {child.exitcode}"
    output = out.read_text()
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert len(rows) == len(CASES), output[-2000:]
    report = []
    for row in rows:
        name, est = expected[row["config"]]
        measured, estimated = row["peak_bytes"], est.memory.total
        report.append(f"{name}: measured {measured / 2**20:.1f} MiB, estimated {estimated / 2**20:.1f} MiB "
                      f"({(estimated - measured) / measured:+.1%}); process RSS {row['rss_peak_bytes'] / 2**20:.0f} MiB")
        assert measured > 0
    print("\n".join(report))
    for line, row in zip(report, rows):
        name, est = expected[row["config"]]
        assert abs(est.memory.total - row["peak_bytes"]) <= 0.15 * row["peak_bytes"], line
