"""Stages turn their part of the resolved config into a Job. Pure: no I/O beyond what a stage must look at
on disk to size itself (data preparation counts its input shards; nothing is fetched)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from launcher.config import LaunchConfig
from launcher.job import Job
from runtime.schema.stages import FINE_TUNING_STAGES, STAGE_PROGRAMS, STAGES, TITAN_PROGRAM, TRAINER_STAGES

__all__ = ["FINE_TUNING_STAGES", "STAGES", "TRAINER_STAGES", "BUILDERS", "PROGRAMS"]  # the names live in the schema

# The program each stage runs; a stage whose program is not in this checkout yet cannot be launched.
PROGRAMS = STAGE_PROGRAMS


def _job(cfg: LaunchConfig, stage: str, *args: str, **sizing) -> Job:
    from runtime.schema.choices import DEFAULT_DEPENDENCY  # here: tab completion imports this module, not the choices

    section = cfg.stage(stage)
    results_dir = section.results_dir
    return Job(
        stage=stage,
        run_name=cfg.run_name,
        results_dir=results_dir,
        program=("-m", PROGRAMS[stage], "--config", str(results_dir / f"{stage}_config.yaml"), *args),
        time_limit=str(section.run.time_limit),
        dependency=section.run.dependency or DEFAULT_DEPENDENCY,
        stage_config=section.section,
        **sizing,
    )


def data_preparation(cfg: LaunchConfig, *, tasks: int | None = None) -> Job:
    """One array task per input shard. `tasks` is for inputs that are not on disk to count (S3: staging.py)."""
    from runtime.data_prep.plan import count_tasks  # torch-free by contract (docs/architecture.md)

    section = cfg.stage("data_preparation")
    tasks = tasks if tasks is not None else count_tasks(section.section)
    return _job(
        cfg, "data_preparation",
        nodes=1, nproc_per_node=1, distributed=False,
        array_size=tasks, array_parallel=min(tasks, int(section.run.node_array_size or tasks)),
    )


def _trainer_job(cfg: LaunchConfig, stage: str) -> Job:
    """A stage the trainer runs: torchrun over num_nodes x devices, preemptible like training. Only training's
    command line stays as it always was; the others name their stage."""
    from runtime.schema.training import parse_fault_tolerance

    section = cfg.stage(stage)
    trainer, run = section.trainer, section.run
    assert trainer is not None, f"{stage}.trainer: validated before any job is built"
    fault_tolerance = parse_fault_tolerance(section.section, f"{stage}.")[0]
    # A recipe without the preemption keys gets a script that handles no signals (validate.py checks values).
    return _job(
        cfg, stage, *(() if stage == "training" else ("--stage", stage)),
        nodes=trainer.num_nodes, nproc_per_node=trainer.devices, distributed=True, accelerator=trainer.accelerator,
        preemption_signal_s=int(run.preemption_signal_s or 0) or None,
        max_restarts=int(run.max_restarts or 0),
        fault_tolerance=fault_tolerance if fault_tolerance is not None and fault_tolerance.enabled else None,
        elastic=bool(getattr(run, "elastic", False) or False),
    )


def training(cfg: LaunchConfig) -> Job:
    """Our trainer, or with training.runtime=torchtitan torchtitan's on the module the launch writes beside the stage
    config (launcher/titan.py): the same job otherwise, run by the same scripts."""
    job = _trainer_job(cfg, "training")
    if not runs_torchtitan(job.stage_config):
        return job
    return dataclasses.replace(job, program=("-m", TITAN_PROGRAM, "--job", str(titan_module_path(job))))


# The generated module of a torchtitan job (launcher/titan.py), written beside the stage config (contract 2).
TITAN_MODULE = "training_titan_job.py"


def runs_torchtitan(stage_config: dict) -> bool:
    """training.runtime=torchtitan, as the schema reads it."""
    from runtime.schema.training import parse_runtime

    return parse_runtime(stage_config)[0] == "torchtitan"


def titan_module_path(job: Job) -> Path:
    return job.config_path.with_name(TITAN_MODULE)


def fine_tuning(cfg: LaunchConfig) -> Job:
    """Full-parameter SFT from model.restore_from_path on model.data.train_ds (NeMo-Launcher's fine_tuning)."""
    return _trainer_job(cfg, "fine_tuning")


def peft(cfg: LaunchConfig) -> Job:
    """LoRA adapters on frozen weights from model.restore_from_path (NeMo-Launcher's peft)."""
    return _trainer_job(cfg, "peft")


def alignment(cfg: LaunchConfig) -> Job:
    """Preference alignment (DPO or ORPO, NxD Training's model_alignment_strategy) from model.restore_from_path on
    prompt/chosen/rejected pairs."""
    return _trainer_job(cfg, "alignment")


def rlhf_rm(cfg: LaunchConfig) -> Job:
    """A reward model (NeMo-Launcher's rlhf_rm: a scalar score head, TRL RewardTrainer's Bradley-Terry loss) from
    model.restore_from_path on prompt/chosen/rejected pairs."""
    return _trainer_job(cfg, "rlhf_rm")


def rl(cfg: LaunchConfig) -> Job:
    """GRPO (TRL's GRPOTrainer's objective) from model.restore_from_path or random init on {"prompt", "answer"}
    records: each step samples completions from the policy, scores them with the grpo.reward function and trains."""
    return _trainer_job(cfg, "rl")


def conversion(cfg: LaunchConfig) -> Job:
    return _job(cfg, "conversion", nodes=1, nproc_per_node=1, distributed=False)


def evaluation(cfg: LaunchConfig) -> Job:
    evaluation = cfg.stage("evaluation").evaluation
    assert evaluation is not None, "evaluation: validated before any job is built"
    return _job(
        cfg, "evaluation",
        nodes=evaluation.num_nodes, nproc_per_node=evaluation.devices, distributed=True,
        accelerator=evaluation.accelerator,
    )


# Each stage's job is built by the function above that bears its name.
BUILDERS: dict[str, Callable[[LaunchConfig], Job]] = {stage: globals()[stage] for stage in STAGES}
