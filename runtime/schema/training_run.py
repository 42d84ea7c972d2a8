"""The job's sections of a training stage config: run, fault_tolerance, trainer, precision and exp_manager (the
checkpoints and the loggers), each read into its typed config (runtime/schema/training_config.py)."""
from __future__ import annotations

from pathlib import Path

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.reader import Report, Section
from runtime.schema.training_config import CheckpointConfig, FaultToleranceConfig, TrainerConfig


def read_run(run: Section, p: str, report: Report) -> bool | None:
    """run.*: the job's own keys (the launcher renders them into #SBATCH lines; the runtime reads results_dir).
    Returns run.elastic (None if it is not a bool): whether the job goes on with fewer data-parallel replicas after
    it loses a node and has no spare (its layout rule is training_layout.elastic_rules)."""
    report.error(rules.results_dir(run.raw("results_dir", None), p))
    limit = run.raw("time_limit", None)
    report.error(rules.time_limit(limit, p))
    run.choice("dependency", C.DEPENDENCIES, C.DEFAULT_DEPENDENCY)
    signal_s = run.int("preemption_signal_s", 0)
    if signal_s is not None:
        report.error(rules.preemption_signal(signal_s, "" if limit is None else str(limit), p))
    run.int("max_restarts", 0, minimum=0)
    return run.bool("elastic", False)


def read_runtime(root: Section, p: str) -> str | None:
    """<stage>.runtime: which runtime trains the stage. torchtitan pretrains only: the fine-tuning, alignment and rl
    stages are this project's runtime's alone (launcher/titan.py maps the training stage's keys)."""
    runtime = root.choice("runtime", C.RUNTIMES, "nxdt")
    stage = p.rstrip(".")
    if runtime == "torchtitan" and stage != "training":
        root.report.error(f"{p}runtime: torchtitan runs the training stage (pretraining) only; {stage} runs on "
                          f"nxdt-launch's own runtime: unset {p}runtime or set it to nxdt")
        return None
    return runtime


def read_fault_tolerance(s: Section, report: Report) -> FaultToleranceConfig | None:
    values = dict(
        enabled=s.bool("enabled", True),
        setup_timeout_s=s.float("setup_timeout_s", 1800, above=0),
        step_timeout_s=s.float("step_timeout_s", None, above=0),
        step_timeout_factor=s.float("step_timeout_factor", 5.0, above=1),
        step_timeout_floor_s=s.float("step_timeout_floor_s", 300, above=0),
        checkpoint_timeout_s=s.float("checkpoint_timeout_s", 1800, above=0),
        in_job_restarts=s.int("in_job_restarts", 3, minimum=0),
        requeues_on_failure=s.int("requeues_on_failure", 2, minimum=0),
        same_node_failures=s.int("same_node_failures", 2, minimum=1),
        peer_state_every_n_steps=s.int("peer_state_every_n_steps", 0, minimum=0),
        spare_nodes=s.int("spare_nodes", 0, minimum=0),
    )
    s.done()
    if any(v is None for k, v in values.items() if k != "step_timeout_s"):
        return None
    return FaultToleranceConfig(**values)


def read_trainer(s: Section, p: str, report: Report) -> TrainerConfig | None:
    fraction = rules.val_check_whole(s.raw("val_check_interval", 0), p)
    report.error(fraction)
    values = dict(
        num_nodes=s.int("num_nodes", 1, minimum=1),
        devices=s.int("devices", 1, minimum=1),
        accelerator=s.choice("accelerator", C.ACCELERATORS, "cpu"),
        max_steps=s.int("max_steps", minimum=1),
        log_every_n_steps=s.int("log_every_n_steps", 10, minimum=1),
        val_check_interval=None if fraction else s.int("val_check_interval", 0, minimum=0),
        limit_val_batches=s.int("limit_val_batches", 0, minimum=0),
        gradient_clip_val=s.float("gradient_clip_val", 0.0, minimum=0.0),
        preflight=s.bool("preflight", False),
        preflight_timeout_s=s.float("preflight_timeout_s", 60.0, minimum=1.0),
    )
    return None if any(v is None for v in values.values()) else TrainerConfig(**values)


def read_precision(precision: Section) -> str | None:
    return precision.choice("type", C.PRECISION_TYPES, "fp32")


def read_checkpoint(exp: Section, run: Section, p: str) -> CheckpointConfig | None:
    params = exp.section("checkpoint_callback_params")
    top_k = params.int("save_top_k", -1)
    if top_k is not None:
        exp.report.error(rules.save_top_k(top_k, p))
    resume_from = exp.raw("resume_from_checkpoint", None)
    results_dir = run.raw("results_dir", "")
    values = dict(
        enabled=exp.bool("create_checkpoint_callback", True),
        dirpath=str(params.raw("dirpath", Path(str(results_dir)) / "checkpoints")),
        every_n_train_steps=params.int("every_n_train_steps", 0, minimum=0),
        save_top_k=top_k,
        save_last=params.bool("save_last", True),
        async_save=params.bool("async_save", True),
        load_on_one_replica=params.bool("load_on_one_replica", True),
        resume_if_exists=exp.bool("resume_if_exists", False),
        save_on_signal=exp.bool("create_preemption_callback", True),
    )
    if any(v is None for v in values.values()):
        return None
    return CheckpointConfig(resume_from_checkpoint=None if resume_from is None else str(resume_from), **values)


# NeMo's exp_manager.wandb_logger_kwargs (Lightning's WandbLogger arguments) that mean something without Lightning.
WANDB_KEYS = ("project", "name", "group", "tags", "entity", "notes", "job_type", "offline", "save_dir", "id",
              "version", "resume")


def read_wandb_kwargs(exp: Section, p: str, report: Report) -> dict:
    kwargs = exp.mapping("wandb_logger_kwargs") or {}
    for key in sorted(set(kwargs) - set(WANDB_KEYS)):
        report.error(f"{p}exp_manager.wandb_logger_kwargs.{key}: not a W&B setting nxdt-launch passes on; "
                     f"valid: {', '.join(WANDB_KEYS)}")
    return {k: v for k, v in kwargs.items() if k in WANDB_KEYS}
