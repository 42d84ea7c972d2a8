"""torchtitan trains on our data in 2 processes (torchrun, gloo) on CPU, with the FAKE accelerator of
tests/titan/cpu_shim.py standing in for the Neuron/CUDA device: FSDP checkpoints and resumes bitwise, and tensor
parallelism trains. The job module is rendered from a hand-written context by launcher/titan_module.py and run by
`python -m runtime.titan.train --job` (contract 2 of issue 60)."""
import math
import shutil

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is the optional extra nxdt-launch[torchtitan]")

from tests.titan.conftest import context, losses, run_titan, write_job

FSDP = {"data_parallel_shard_degree": 2}
TP = {"tensor_parallel_degree": 2}
CHECKPOINT = {"enable": True, "interval": 2, "keep_latest_k": 0}


def test_fsdp_checkpoints_at_step_2_and_a_resume_repeats_steps_3_and_4_bitwise(corpus, tmp_path):
    whole = tmp_path / "whole"
    run_titan(write_job(context(corpus, whole, parallelism=FSDP, checkpoint=CHECKPOINT), tmp_path / "whole.py"), 2)
    # torchtitan's layout: <dump_folder>/<checkpoint.folder>/step-N, each a DCP directory (.metadata).
    assert sorted(p.name for p in (whole / "checkpoint").iterdir()) == ["step-2", "step-4"]
    assert (whole / "checkpoint" / "step-2" / ".metadata").is_file()
    uninterrupted = losses(whole)
    assert sorted(uninterrupted) == [1, 2, 3, 4] and all(math.isfinite(v) for v in uninterrupted.values())

    # Resume: a new run whose checkpoint folder holds the uninterrupted run's step 2 starts at step 3, with the
    # model, optimizer, lr schedule and data position ({"consumed_samples": 8}) of that step.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_titan(write_job(context(corpus, resumed, parallelism=FSDP, checkpoint=CHECKPOINT), tmp_path / "resumed.py"),
              2)
    assert losses(resumed) == {3: uninterrupted[3], 4: uninterrupted[4]}  # bitwise: the same floats


def test_tensor_parallel_trains(corpus, tmp_path):
    run = tmp_path / "tp"
    ctx = context(corpus, run, parallelism=TP, training={"steps": 6}, optimizer={"lr": 1e-2})
    run_titan(write_job(ctx, tmp_path / "tp.py"), 2)
    by_step = losses(run)
    assert sorted(by_step) == list(range(1, 7)) and all(math.isfinite(v) for v in by_step.values())
    assert by_step[6] < by_step[1], by_step
