"""Stages turn their part of the resolved config into a Job. Pure: no I/O beyond what a stage must look at
on disk to size itself (data preparation counts its input shards; nothing is fetched)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from launcher.job import Job

STAGES = ("data_preparation", "training", "fine_tuning", "peft", "alignment", "conversion", "evaluation")
# Stages that run the trainer (runtime.train): one config schema (runtime/schema/training.py), one kind of job
# (the same job shape, checkpoints, preemption and metrics).
# fine_tuning is full-parameter SFT, peft is LoRA, alignment is DPO or ORPO on preference pairs (full-parameter or
# LoRA); the trainer is told which with --stage, which names their keys.
TRAINER_STAGES = ("training", "fine_tuning", "peft", "alignment")
# The trainer stages that start from model.restore_from_path and read record files (model.data.train_ds).
FINE_TUNING_STAGES = ("fine_tuning", "peft", "alignment")


def _job(cfg: dict[str, Any], stage: str, module: str, *args: str, **sizing: Any) -> Job:
    from runtime.schema.choices import DEFAULT_DEPENDENCY  # here: tab completion imports this module, not the schema

    stage_cfg = cfg[stage]
    run = stage_cfg["run"]
    results_dir = Path(run["results_dir"])
    return Job(
        stage=stage,
        run_name=cfg["run_name"],
        results_dir=results_dir,
        program=("-m", module, "--config", str(results_dir / f"{stage}_config.yaml"), *args),
        time_limit=str(run["time_limit"]),
        dependency=run.get("dependency") or DEFAULT_DEPENDENCY,
        stage_config=stage_cfg,
        **sizing,
    )


def data_preparation(cfg: dict[str, Any], *, tasks: int | None = None) -> Job:
    """One array task per input shard. `tasks` is for inputs that are not on disk to count (S3: staging.py)."""
    from runtime.data_prep.plan import count_tasks  # torch-free by contract (docs/architecture.md)

    stage_cfg = cfg["data_preparation"]
    tasks = tasks if tasks is not None else count_tasks(stage_cfg)
    return _job(
        cfg, "data_preparation", "runtime.data_prep",
        nodes=1, nproc_per_node=1, distributed=False,
        array_size=tasks, array_parallel=min(tasks, int(stage_cfg["run"].get("node_array_size") or tasks)),
    )


def _trainer_job(cfg: dict[str, Any], stage: str) -> Job:
    """A stage the trainer runs: torchrun over num_nodes x devices, preemptible like training. Only training's
    command line stays as it always was; the others name their stage."""
    trainer, run = cfg[stage]["trainer"], cfg[stage]["run"]
    # A recipe without the preemption keys gets a script that handles no signals (validate.py checks values).
    return _job(
        cfg, stage, "runtime.train", *(() if stage == "training" else ("--stage", stage)),
        nodes=int(trainer["num_nodes"]), nproc_per_node=int(trainer["devices"]), distributed=True,
        preemption_signal_s=int(run.get("preemption_signal_s") or 0) or None,
        max_restarts=int(run.get("max_restarts") or 0),
    )


def training(cfg: dict[str, Any]) -> Job:
    return _trainer_job(cfg, "training")


def fine_tuning(cfg: dict[str, Any]) -> Job:
    """Full-parameter SFT from model.restore_from_path on model.data.train_ds (NeMo-Launcher's fine_tuning)."""
    return _trainer_job(cfg, "fine_tuning")


def peft(cfg: dict[str, Any]) -> Job:
    """LoRA adapters on frozen weights from model.restore_from_path (NeMo-Launcher's peft)."""
    return _trainer_job(cfg, "peft")


def alignment(cfg: dict[str, Any]) -> Job:
    """Preference alignment (DPO or ORPO, NxD Training's model_alignment_strategy) from model.restore_from_path on
    prompt/chosen/rejected pairs."""
    return _trainer_job(cfg, "alignment")


def conversion(cfg: dict[str, Any]) -> Job:
    return _job(cfg, "conversion", "runtime.convert", nodes=1, nproc_per_node=1, distributed=False)


def evaluation(cfg: dict[str, Any]) -> Job:
    trainer = cfg["evaluation"]["trainer"]
    return _job(
        cfg, "evaluation", "runtime.evaluate",
        nodes=int(trainer["num_nodes"]), nproc_per_node=int(trainer["devices"]), distributed=True,
    )


BUILDERS: dict[str, Callable[[dict[str, Any]], Job]] = {
    "data_preparation": data_preparation,
    "training": training,
    "fine_tuning": fine_tuning,
    "peft": peft,
    "alignment": alignment,
    "conversion": conversion,
    "evaluation": evaluation,
}

# The program each stage runs; a stage whose program is not in this checkout yet cannot be launched.
PROGRAMS = {
    "data_preparation": "runtime.data_prep",
    "training": "runtime.train",
    "fine_tuning": "runtime.train",
    "peft": "runtime.train",
    "alignment": "runtime.train",
    "conversion": "runtime.convert",
    "evaluation": "runtime.evaluate",
}
