"""The launch config, typed: the one place the launcher reads the dict Hydra composed (launcher/cache.resolved).
`parse` runs once a launch has passed `shape` (stages a list, each listed stage a mapping with a run
mapping, cluster a mapping); everything after it reads attributes of a `LaunchConfig`, never keys.

Values that validate.py (or neuron.py, remote.py, staging.py) judges later are kept as composed (typed `Any`), so
that a bad one is reported there with the key, the value and the fix, as before. Where the schema has a parser for
a section, its typed result is used (one owner per key): the trainer stages' `trainer`
(runtime/schema/training.py) and evaluation's (runtime/schema/evaluation.py). A stage's section is also kept
verbatim, for what goes to the schema's parsers and what is written out as it is: <stage>_config.yaml, which the
stage's program parses with the same schema on the node, and the staging plan, which walks it for s3:// URLs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from launcher.paths import group_choices
from runtime.schema.stages import FINE_TUNING_STAGES, STAGES, TRAINER_STAGES  # noqa: F401 (the launcher's names)

if TYPE_CHECKING:  # the stage schemas are imported when a launch is parsed: tab completion imports this module
    from runtime.schema.evaluation import EvaluationConfig
    from runtime.schema.training_config import TrainerConfig

# Keys of the cluster group that become #SBATCH lines, and the other keys the group may hold (checked by neuron.py,
# remote.py, staging.py, validate.py).
SBATCH_KEYS = ("partition", "account", "exclusive", "mem", "gres", "exclude", "nodelist", "qos", "reservation")
OTHER_CLUSTER_KEYS = ("job_name_prefix", "srun_args", "setup", "env_vars", "workers_per_node", "venv",
                      "neuron", "remote", "staging", "s3", "node_memory_gib", "hyperpod", "k8s")


@dataclass(frozen=True)
class Run:
    """<stage>.run: the job's own keys (the trainer stages' are checked by the training schema, the others' by
    validate.py)."""

    name: Any = None
    results_dir: Any = None
    time_limit: Any = None
    dependency: Any = None
    node_array_size: Any = None      # data_preparation: array tasks at once
    preemption_signal_s: Any = None  # trainer stages: SIGUSR1 this long before time_limit
    max_restarts: Any = None
    elastic: Any = None              # trainer stages: go on with fewer data-parallel replicas after a lost node


@dataclass(frozen=True)
class StageInputs:
    """What a trainer stage reads and writes, as its section names them: the checks that run before the schema's
    full reading (validate.py: does this launch prepare the data, restore from its own checkpoints; packages.py:
    which loggers it needs) run in a dry run too, where the schema returns no typed config because files a real run
    would find are missing. Values are as written; the schema judges them."""

    data_prefix: Any = None          # model.data.data_prefix
    tokenizer: Any = None            # model.tokenizer.model
    record_files: tuple[Any, ...] = ()  # model.data.{train_ds,validation_ds}.file_names (fine-tuning, alignment)
    restore_from_path: Any = None    # model.restore_from_path
    checkpoint_dir: Any = None       # exp_manager.checkpoint_callback_params.dirpath
    wandb: bool = False              # exp_manager.create_wandb_logger
    tensorboard: bool = True         # exp_manager.create_tensorboard_logger
    well_formed: bool = True         # model, model.data and model.tokenizer are mappings
    # trainer.accelerator and trainer.devices as given, for a message beside the schema's where it refuses them
    accelerator: Any = None
    devices: Any = None
    # What shapes the stage's graphs, as written (launcher/neuron.py names its compile cache and graphs by a hash of
    # it): the model section without its data, model.data.seq_length, the precision section.
    architecture: Any = "model"      # model.architecture ("model" when the key is absent)
    model_without_data: dict[str, Any] = field(default_factory=dict)
    seq_length: Any = None           # model.data.seq_length
    precision: Any = None


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def stage_inputs(section: Mapping[str, Any]) -> StageInputs:
    model = _mapping(section.get("model"))
    data, tokenizer = model.get("data") or {}, model.get("tokenizer") or {}
    exp = section.get("exp_manager") or {}
    files: list[Any] = []
    for split in ("train_ds", "validation_ds"):
        names = _mapping(_mapping(data).get(split)).get("file_names")
        files += names if isinstance(names, list) else [names]
    trainer = _mapping(section.get("trainer"))
    return StageInputs(
        accelerator=trainer.get("accelerator"), devices=trainer.get("devices"),
        architecture=model.get("architecture", "model"),
        model_without_data={k: v for k, v in model.items() if k != "data"},
        seq_length=_mapping(model.get("data")).get("seq_length"),
        precision=section.get("precision"),
        data_prefix=_mapping(data).get("data_prefix"), tokenizer=_mapping(tokenizer).get("model"),
        record_files=tuple(files), restore_from_path=model.get("restore_from_path"),
        checkpoint_dir=_mapping(_mapping(exp).get("checkpoint_callback_params")).get("dirpath"),
        wandb=isinstance(exp, dict) and exp.get("create_wandb_logger") is True,
        tensorboard=isinstance(exp, dict) and exp.get("create_tensorboard_logger", True) is True,
        well_formed=isinstance(data, dict) and isinstance(tokenizer, dict))


def cut_to_steps(section: dict[str, Any], steps: int, results_dir: str) -> dict[str, Any]:
    """A copy of a trainer section cut to `steps` steps, its results in `results_dir`, with no TensorBoard logger and
    no resume (the Neuron precompile's config, launcher/neuron.py). A warmup longer than the run is cut to it, which
    the trainer would refuse.

    It runs every kind of graph the real run will, so that the real run finds each in the compile cache: training
    steps (every one logged), a validation, a checkpoint save and a step after it. With at least two steps, the
    validation and the save come at step steps - 1 (if the section validates and saves at all) and again at the
    end, after the last step."""
    import copy

    steps = max(int(steps), 2)
    stage = copy.deepcopy(section)
    trainer = stage.setdefault("trainer", {})
    trainer["max_steps"] = steps
    trainer["log_every_n_steps"] = 1
    if int(trainer.get("val_check_interval") or 0) > 0:
        trainer["val_check_interval"] = steps - 1
    stage.setdefault("run", {})["results_dir"] = results_dir
    exp_manager = stage.setdefault("exp_manager", {})
    exp_manager["create_tensorboard_logger"] = False
    exp_manager["resume_if_exists"] = False
    if exp_manager.get("create_checkpoint_callback", True) is not False:
        # Its own checkpoints, never where the real run resumes from (they hold zeros under neuron_parallel_compile).
        params = exp_manager.get("checkpoint_callback_params")
        exp_manager["checkpoint_callback_params"] = {**(params if isinstance(params, dict) else {}),
                                                     "every_n_train_steps": steps - 1,
                                                     "dirpath": f"{results_dir}/checkpoints"}
    sched = ((stage.get("model") or {}).get("optim") or {}).get("sched")
    if isinstance(sched, dict):
        sched["warmup_steps"] = min(int(sched.get("warmup_steps") or 0), steps)
        sched["constant_steps"] = min(int(sched.get("constant_steps") or 0), steps - sched["warmup_steps"])
    return stage


def without_restore(section: dict[str, Any]) -> dict[str, Any]:
    """The section with model.restore_from_path unset: for the schema's reading of a stage that restores from
    checkpoints an earlier stage of the same launch has not written yet."""
    return {**section, "model": {**_mapping(section.get("model")), "restore_from_path": None}}


@dataclass(frozen=True)
class Stage:
    name: str
    run: Run
    section: dict[str, Any] = field(repr=False)  # the resolved subtree, as the stage's program reads it
    # The schema's reading of the keys a job is sized by; None for other stages, and where the section is invalid
    # (validate.py reports it, and no job is built).
    trainer: TrainerConfig | None = None          # training, fine_tuning, peft, alignment
    evaluation: EvaluationConfig | None = None

    @property
    def results_dir(self) -> Path:
        return Path(self.run.results_dir)

    @property
    def inputs(self) -> StageInputs:
        return stage_inputs(self.section)


@dataclass(frozen=True)
class Cluster:
    """The cluster group (conf/cluster/). Its sub-sections are checked by their own modules (neuron.py,
    remote.py, staging.py) and cluster.s3 by the schema; here they are as composed."""

    sbatch: dict[str, Any]           # SBATCH_KEYS that are set, in SBATCH_KEYS order
    keys: tuple[str, ...]            # every key the group holds, for the unknown-key check
    job_name_prefix: Any = None
    srun_args: Any = None
    setup: Any = None
    env_vars: Any = None
    workers_per_node: Any = None
    venv: Any = None
    neuron: Any = None
    remote: Any = None
    staging: Any = None
    s3: Any = None
    node_memory_gib: Any = None      # host memory of one node (validate.cluster checks it); null: the instance's
    hyperpod: Any = None             # SageMaker HyperPod's Slurm: the training step as `srun --auto-resume=1`
    k8s: Any = None                  # cluster_type=k8s: the manifests' settings (launcher/k8s.py checks them)

    @property
    def partition(self) -> Any:
        return self.sbatch.get("partition")

    @property
    def nodelist(self) -> Any:
        return self.sbatch.get("nodelist")

    @property
    def exclude(self) -> Any:
        return self.sbatch.get("exclude")

    @property
    def staging_local_dir(self) -> Any:
        """cluster.staging.local_dir: the S3 mirror's root on the shared file system (staging.py checks it)."""
        return self.staging.get("local_dir") if isinstance(self.staging, Mapping) else None

    @property
    def node_memory_bytes(self) -> float | None:
        """cluster.node_memory_gib in bytes where it is a positive number (validate.cluster names any other value);
        None: the instance's documented memory (launcher/estimator/hardware.py), or for cpu this machine's."""
        value = self.node_memory_gib
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
            return float(value) * 2**30
        return None

    @property
    def neuron_hardware(self) -> Any:
        """cluster.neuron.hardware: a Neuron cluster's instance type (neuron.py checks it); None elsewhere."""
        return self.neuron.get("hardware") if isinstance(self.neuron, Mapping) else None


@dataclass(frozen=True)
class LaunchConfig:
    stages: tuple[str, ...]          # as listed (validate.py names the unknown and the repeated ones)
    sections: dict[str, Stage]       # each stage, listed or known, that has a mapping with a run mapping
    cluster: Cluster
    run_name: Any = None
    base_results_dir: Any = None
    data_dir: Any = None
    cluster_type: Any = None
    container: Any = None
    container_mounts: Any = None
    python: Any = None
    env_vars: Any = None
    dry_run: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # as composed, for config_hash

    def stage(self, name: str) -> Stage:
        return self.sections[name]

    def composed_section(self, name: str) -> Any:
        """A section as composed, before anything has checked it (`nxdt-launch estimate` hands training's to the
        schema itself, run mapping or not; cluster-validate checks its own and the cluster group)."""
        return self.raw.get(name)

    @property
    def run_dir(self) -> Path:
        return Path(self.base_results_dir) / self.run_name


def shape(cfg: dict[str, Any]) -> list[str]:
    """What `parse` reads, checked before it: `stages` a list of names, each listed stage a mapping with a `run`
    mapping, `cluster` a mapping. One line per problem, as every check of the launch."""
    stages = cfg.get("stages")
    if not isinstance(stages, list) or not stages or not all(isinstance(s, str) for s in stages):
        return [f"stages: {stages!r} must be a non-empty list of stage names such as stages=[training] "
                f"(valid: {', '.join(STAGES)})"]
    errors = []
    for stage in dict.fromkeys(s for s in stages if s in STAGES):
        section = cfg.get(stage)
        if not isinstance(section, dict):
            errors.append(f"{stage}: {section!r} is not a stage config; choose one with {stage}=NAME "
                          f"(valid: {', '.join(group_choices(stage))})")
        elif not isinstance(section.get("run"), dict):
            errors.append(f"{stage}.run: {section.get('run')!r} must be a mapping of the stage's job settings "
                          f"(results_dir, time_limit, ...); set its keys one at a time, "
                          f"e.g. {stage}.run.time_limit=1:00:00")
    if not isinstance(cfg.get("cluster") or {}, dict):
        errors.append(f"cluster: {cfg.get('cluster')!r} must be a mapping; choose one with cluster=NAME "
                      f"(valid: {', '.join(group_choices('cluster'))})")
    return errors


def parse_cluster(section: Mapping[str, Any] | None) -> Cluster:
    section = section or {}
    lists = {"srun_args": [], "setup": []}  # absent means none; null is not a list (validate.cluster says so)
    return Cluster(
        sbatch={key: section[key] for key in SBATCH_KEYS if key in section},
        keys=tuple(section),
        **{key: section.get(key, lists.get(key)) for key in OTHER_CLUSTER_KEYS},
    )


def composed_run(section: Mapping[str, Any]) -> Any:
    """A section's run as composed, null read as {}: for a check that names a value that is not a mapping (what
    cluster-validate, whose section is not a launch stage's, does before parse_run)."""
    return section.get("run") or {}


def parse_run(run: Mapping[str, Any]) -> Run:
    return Run(**{key: run.get(key) for key in Run.__dataclass_fields__})


def _stage(name: str, section: Mapping[str, Any]) -> Stage:
    from runtime.schema.evaluation import parse_evaluation
    from runtime.schema.training import parse_trainer

    return Stage(
        name=name, run=parse_run(section["run"]), section=dict(section),
        trainer=parse_trainer(section, f"{name}.")[0] if name in TRAINER_STAGES else None,
        evaluation=parse_evaluation(section, f"{name}.")[0] if name == "evaluation" else None,
    )


def parse(cfg: Mapping[str, Any]) -> LaunchConfig:
    """The composed config as a LaunchConfig. Lenient beyond `shape`: a stage that is not a mapping with a
    run mapping (cluster-validate's, or one shape() has reported) has no entry in `sections`. The composed config
    holds every known stage's section whether listed or not; each can be built alone (tests, autoconfig)."""
    listed = cfg.get("stages")
    stages = tuple(str(s) for s in listed) if isinstance(listed, list) else ()
    sections = {s: _stage(s, cfg[s]) for s in dict.fromkeys((*stages, *STAGES))
                if isinstance(cfg.get(s), Mapping) and isinstance(cfg[s].get("run"), Mapping)}
    cluster = cfg.get("cluster")
    return LaunchConfig(
        stages=stages, sections=sections, cluster=parse_cluster(cluster if isinstance(cluster, Mapping) else None),
        run_name=cfg.get("run_name"), base_results_dir=cfg.get("base_results_dir"), data_dir=cfg.get("data_dir"),
        cluster_type=cfg.get("cluster_type"), container=cfg.get("container"),
        container_mounts=cfg.get("container_mounts"), python=cfg.get("python"), env_vars=cfg.get("env_vars"),
        dry_run=bool(cfg.get("dry_run")), raw=dict(cfg),
    )


def typed(cfg: LaunchConfig | Mapping[str, Any]) -> LaunchConfig:
    """What the entry points that tests and commands call with the composed dict (launch.build, render.render,
    render.container, render.python, staging.for_job) read: parsed here, or as parsed already."""
    return cfg if isinstance(cfg, LaunchConfig) else parse(cfg)
