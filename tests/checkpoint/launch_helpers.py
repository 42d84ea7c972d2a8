"""A small counting corpus on disk and the launcher overrides that train on it, for the checkpoint tests that
run the real CLI (local executor or the 3-node Slurm cluster)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.checkpoint import committed_checkpoints, full_tensors, open_storage, read_rank_files
from tests.runtime_train.helpers import build_tokenizer, write_mmidx

NUM_WORDS = 64


def counting_corpus(directory: Path) -> Path:
    """Documents where token[t+1] = token[t] + stride (mod 64): learnable, so losses move step to step."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory / "tokenizer.json", [f"w{i}" for i in range(NUM_WORDS)])
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(400):
        start, stride, length = rng.integers(NUM_WORDS), rng.choice((1, 2, 3)), rng.integers(60, 200)
        docs.append((start + stride * np.arange(length)) % NUM_WORDS + 1)
    write_mmidx(directory / "count", docs)
    return directory


def training_overrides(data: Path, results: Path, *, steps: int, every: int, hidden: int = 128,
                       extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "stages=[training]", f"base_results_dir={results}", f"data_dir={data}",
        f"training.model.data.data_prefix=[1,{data}/count]", f"training.model.tokenizer.model={data}/tokenizer.json",
        f"training.trainer.max_steps={steps}", "training.trainer.log_every_n_steps=1",
        "training.trainer.val_check_interval=0", "training.trainer.preflight=false",
        "training.model.encoder_seq_length=64", f"training.model.hidden_size={hidden}", "training.model.num_layers=2",
        "training.model.make_vocab_size_divisible_by=16", "training.model.global_batch_size=8",
        "training.model.micro_batch_size=2", "training.model.optim.sched.warmup_steps=2",
        f"training.exp_manager.checkpoint_callback_params.every_n_train_steps={every}",
        "training.exp_manager.checkpoint_callback_params.save_top_k=-1",
        f"training.model.data.index_mapping_dir={results}/index",
        "training.exp_manager.create_metrics_plot=false",  # a second of matplotlib per run; test_pipeline draws it
        # Importing tensorboard costs the main rank most of a CPU second per run; nothing here reads its events.
        "training.exp_manager.create_tensorboard_logger=false",
        *extra,
    ]


def train_here(config: str, stage: str = "training") -> int:
    """`python -m runtime.train --config CONFIG --stage STAGE` as one torchrun worker, in a rank run_distributed
    forked from the test process (already in the world, on one thread as torchrun's workers are): no fresh
    interpreter importing torch, where the launch itself is not what a test is about."""
    import os

    import torch.distributed as dist

    from runtime.train import main

    os.environ["RANK"] = str(dist.get_rank())  # as torchrun sets it: the trainer reads it before joining
    return main(["--config", config, "--stage", stage])


def train_rendered(config: Path, stage: str = "training") -> list[int]:
    """Every rank's exit code of a stage config the launcher rendered (--dry-run), its trainer.num_nodes x
    trainer.devices ranks forked from this process (train_here)."""
    import yaml

    import runtime.train  # noqa: F401  (imported once here, not in every forked rank: most of a CPU second each)
    from tests.runtime_parallel.dist_utils import run_distributed

    trainer = yaml.safe_load(Path(config).read_text())["trainer"]
    return run_distributed(train_here, int(trainer["num_nodes"]) * int(trainer["devices"]), args=(str(config), stage))


def convert_rendered(overrides: list[str], cwd: Path, stage_dir: Path) -> None:
    """The conversion stage as the launcher renders it (--dry-run: its script and conversion_config.yaml), the
    script's command run in this process (convert_here). For the tests whose subject is what the stage's code does
    with that config; the stage's script itself runs in tests/test_pipeline.py (this machine and the 3-node Slurm
    cluster)."""
    from tests.launcher.helpers import nxdt

    result = nxdt("cluster_type=local", *overrides, "--dry-run", cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    convert_here(stage_dir)


def convert_here(stage_dir: Path) -> None:
    """The command of the conversion script the launcher rendered into `stage_dir`, run in this process, where torch
    is already imported: a fresh interpreter per conversion would cost more than the conversion."""
    import shlex

    from runtime.convert.__main__ import main

    command = shlex.split((stage_dir / "conversion.local.sh").read_text().strip().splitlines()[-1])
    assert command[:3] == ["$PYTHON", "-m", "runtime.convert"], command
    assert main(command[3:]) == 0


def stages_here(overrides: list[str], cwd: Path, run_dir: Path, stage: str) -> list[int]:
    """`nxdt-launch OVERRIDES` of stages=[STAGE,conversion] as the launcher renders it (--dry-run), then run here:
    STAGE's ranks forked from this process (train_rendered), then the conversion's command in it (convert_here).
    For the tests whose subject is what the stages compute and export; a real launch of fine_tuning and conversion
    is tests/fine_tuning/test_fine_tuning_pipeline.py's. Returns STAGE's ranks' exit codes (all 0)."""
    from tests.launcher.helpers import nxdt

    result = nxdt(*overrides, "--dry-run", cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    codes = train_rendered(run_dir / stage / f"{stage}_config.yaml", stage)
    assert set(codes) == {0}, codes
    convert_here(run_dir / "conversion")
    return codes


def losses(training_dir: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a resumed run appends to the same file)."""
    out = {}
    for line in (training_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def final_weights(checkpoint_dir: str) -> dict:
    storage = open_storage(checkpoint_dir)
    newest = committed_checkpoints(storage)[-1]
    full = full_tensors(read_rank_files(storage, newest.name))
    return newest.step, {name: full.get(name, "value") for name in sorted(full.names())}
