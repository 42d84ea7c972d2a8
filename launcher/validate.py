"""Checks on the resolved config before anything is written or submitted. Pure functions: each returns
one line per problem, naming the key, the bad value and the fix. `problems()` returns (errors, warnings) of a
LaunchConfig (launcher/config.py), whose shape config.shape has checked; the stage sections go to the schema's
parsers as they are, which is how the runtime reads them."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from launcher import remote, staging
from launcher.config import (OTHER_CLUSTER_KEYS, SBATCH_KEYS, Cluster, LaunchConfig, Run, StageInputs,
                             stage_inputs, without_restore)
from launcher.instances import INSTANCES
# The memory checks live in launcher/memory_fit.py; callers import them from here too.
from launcher.memory_fit import host_memory_fit, host_memory_note, memory_fit, stage_memory_fit  # noqa: F401
from launcher.slurm import expand_hostlist, partition_nodes, split_hostlist
from launcher.stages import FINE_TUNING_STAGES, PROGRAMS, STAGES, TRAINER_STAGES
from runtime.schema import choices, rules
from runtime.schema.conversion import parse_conversion
from runtime.schema.evaluation import parse_evaluation
from runtime.schema.s3 import parse_s3
from runtime.schema.training import parse_training, read_training, too_long_paths
from runtime.schema.training_config import SizingConfig

CLUSTER_TYPES = ("auto", "local", "slurm", "bcm", "k8s")

# What may stand in an #SBATCH line: sbatch reads those lines itself, so nothing there may need quoting.
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%+=/\[\]-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def problems(cfg: LaunchConfig, *, dry_run: bool, local: bool, estimates: dict[str, Any] | None = None
             ) -> tuple[list[str], list[str]]:
    """`local`: the local executor runs the stages on this machine (its memory is a CPU node's, memory_fit).
    `estimates`: where each trainer stage's estimate (memory_fit's, from the schema's one reading) is kept."""
    warnings: list[str] = []
    errors = _top_level(cfg)
    if too_long := _too_long_paths(cfg):  # before anything below looks at one on the file system
        return errors + too_long, warnings
    # A stage whose program is missing is already reported; its own checks would only add noise.
    stages = [s for s in cfg.stages if s in STAGES and importlib.util.find_spec(PROGRAMS[s])]
    for stage in stages:
        if stage not in TRAINER_STAGES:  # the training schema checks its own run keys, with the same rules
            errors += _stage_run(cfg.stage(stage).run, stage)
        errors += _results_dir_pattern(cfg.stage(stage).run, stage, cfg)
        if stage in TRAINER_STAGES and (other := another_model(cfg, stage)):
            (warnings if dry_run else errors).append(other)
    if "training" in stages:
        # The runtime runs the same schema on the node. A dry run often renders on a laptop for a cluster whose
        # file system it cannot see: missing files are warnings there.
        _, sizing, report = read_training(cfg.stage("training").section, files="warn" if dry_run else "error",
                                          prepared="data_preparation" in stages)
        errors += report.errors
        warnings += report.warnings
        if not report.errors:
            fit_errors, fit_warnings = memory_fit(cfg, local=local, sizing=sizing, keep=estimates)
            errors += fit_errors
            warnings += fit_warnings
        if "data_preparation" in stages:
            errors += _trains_on_prepared_data(cfg)
    for stage in FINE_TUNING_STAGES:
        if stage in stages:
            stage_errors, stage_warnings, sizing = _fine_tuning(cfg, stage, stages, dry_run=dry_run)
            if not stage_errors:
                fit_errors, fit_warnings = memory_fit(cfg, stage, local=local, sizing=sizing, keep=estimates)
                stage_errors += fit_errors
                stage_warnings += fit_warnings
            errors += stage_errors
            warnings += stage_warnings
    # The other stages' programs run the same parsers on the node.
    if "conversion" in stages:
        errors += parse_conversion(cfg.stage("conversion").section)[1].errors
    if "evaluation" in stages:
        evaluation, report = parse_evaluation(cfg.stage("evaluation").section)
        errors += report.errors
        if evaluation is not None:
            # A dry run may render for a cluster whose files it cannot see: missing data is a warning there.
            name_errors, missing = lm_eval_tasks(evaluation)
            errors += name_errors + ([] if dry_run else missing)
            warnings += missing if dry_run else []
    # Inputs on S3 are staged inside the job; staging.problems checks their names, the job the rest.
    preparation = cfg.stage("data_preparation").section if "data_preparation" in stages else None
    if preparation is not None and not staging.s3_values(preparation):
        # A remote launch renders here too (dry_run is true for it), but sizes the array by counting the input
        # files here (docs/remote.md, Limits): for it missing inputs stay errors.
        input_errors, input_warnings = _data_preparation(preparation, dry_run=dry_run and remote.settings(cfg) is None)
        errors += input_errors
        warnings += input_warnings
    errors += cluster(cfg.cluster)
    errors += injected_fault(cfg)
    errors += _evaluates_a_reward_model(cfg.stages)
    return errors, warnings


def _evaluates_a_reward_model(stages: list[str]) -> list[str]:
    """The evaluation stage scores the launch's last trained model as a language model; a reward model (rlhf_rm)
    has a score head instead of one, and its evaluation is the held-out pairwise accuracy it logs while training."""
    trainers = [s for s in stages if s in TRAINER_STAGES]
    if "evaluation" in stages and trainers and trainers[-1] == "rlhf_rm":
        return ["stages: evaluation scores a language model, and rlhf_rm trains a reward model (its held-out pairwise "
                "accuracy is val_reward_accuracy in metrics.jsonl); leave evaluation out of this launch, or "
                "evaluate the policy in another one"]
    return []


def injected_fault(cfg: LaunchConfig) -> list[str]:
    """NXDT_INJECT_FAULT (runtime/schema/faults.py), from env_vars or this environment, which Slurm passes on to
    the job: a malformed one is refused here, not found by the workers after the queue."""
    import os

    from runtime.schema import faults

    values = [os.environ.get(faults.ENV, "")]
    if isinstance(cfg.env_vars, dict):
        values.append(str(cfg.env_vars.get(faults.ENV) or ""))
    return [problem for value in values if (problem := faults.parse(value)[1])]


# What makes a run's checkpoints another model's: a run resumes from the newest checkpoint in its directory.
_MODEL_IDENTITY = ("architecture", "model_config", "num_layers", "hidden_size", "ffn_hidden_size",
                   "num_attention_heads", "num_query_groups", "kv_channels")


def another_model(cfg: LaunchConfig, stage: str) -> str | None:
    """A run name shared by two models (NxD Training's eleven hf_llama files all name their run hf_llama): the
    stage's newest complete checkpoint was saved with another model's config (the config.yaml each checkpoint
    keeps; not the results directory's <stage>_config.yaml, which any launch, a dry run too, points at its own).
    Resuming would load it into this one; refused at launch rather than on the node after the queue."""
    section = cfg.stage(stage)
    checkpoints = Path(str(section.inputs.checkpoint_dir or section.results_dir / "checkpoints"))
    if "://" in str(checkpoints) or not checkpoints.is_dir():
        return None
    complete = [d for d in checkpoints.iterdir() if (d / "COMMIT").is_file() and (d / "config.yaml").is_file()]
    steps = {d: re.match(r"step_(\d+)", d.name) for d in complete}
    newest = max((d for d in complete if steps[d]), key=lambda d: (int(steps[d].group(1)), d.stat().st_mtime),
                 default=None)
    if newest is None:
        return None
    try:
        config, problem = rules.checkpoint_config((newest / "config.yaml").read_bytes(), str(newest / "config.yaml"))
    except OSError:
        return None
    if problem:
        return problem
    try:
        before = stage_inputs(config).model_without_data
    except (ValueError, AttributeError):
        return None
    now = section.inputs.model_without_data
    differs = [f"{key} {before[key]!r} there, {now[key]!r} here" for key in _MODEL_IDENTITY
               if before.get(key) is not None and now.get(key) is not None and before[key] != now[key]]
    if not differs:
        return None
    return (f"{stage}.run.name: {section.run.name!r} already holds checkpoints of another model in {checkpoints} "
            f"({'; '.join(differs)}), which this run would resume from; give it its own {stage}.run.name (or "
            f"base_results_dir), or remove {checkpoints}")


def lm_eval_tasks(evaluation) -> tuple[list[str], list[str]]:
    """(problems with the evaluation stage's lm-eval task names, data they read that is not here), checked where
    lm-eval is installed (the stage checks both again on the node before its model loads, and says the same)."""
    names = [spec.name for spec in evaluation.tasks if spec.type == "lm_eval"]
    if not names or importlib.util.find_spec("lm_eval") is None:
        return [], []
    from launcher import cache
    from runtime.evaluate import lm_tasks  # lm-eval's task index: no torch

    return lm_tasks.resolve(names, evaluation.lm_eval.include_path, evaluation.lm_eval.datasets_cache,
                            own=cache.lm_eval_catalog)[1:]


def _trains_on_prepared_data(cfg: LaunchConfig) -> list[str]:
    inputs, preparation = cfg.stage("training").inputs, cfg.stage("data_preparation")
    if not inputs.well_formed:
        return []  # parse_training has named the malformed section
    problem = rules.trains_on_prepared_data(inputs.data_prefix, inputs.tokenizer,
                                            preparation.section.get("output_dir"), str(preparation.run.name))
    return [problem] if problem else []


def _fine_tuning(cfg: LaunchConfig, stage: str, stages: list[str], *, dry_run: bool
                 ) -> tuple[list[str], list[str], SizingConfig | None]:
    """The fine_tuning / peft / alignment stage config through the training schema (the trainer runs it with
    --stage), and which of them it is. Inputs this launch makes are not looked for: the data and tokenizer when this
    launch's data_preparation writes them, the starting weights when they are the checkpoints of a trainer stage that
    runs before it in this launch (training, or fine_tuning before alignment)."""
    section, inputs = cfg.stage(stage).section, cfg.stage(stage).inputs
    prepared = "data_preparation" in stages and _prepares_inputs(cfg.stage("data_preparation").section, inputs)
    earlier = [s for s in stages[:stages.index(stage)] if s in TRAINER_STAGES]
    if any(_restores_from(cfg, s, inputs.restore_from_path) for s in earlier):
        # The checkpoints do not exist yet; the trainer checks them against the model when it loads them.
        section = without_restore(section)
    _, sizing, report = read_training(section, files="warn" if dry_run else "error", prepared=prepared,
                                      p=f"{stage}.")
    # Without the earlier stage's checkpoints the estimator reads the model's shape from the YAML either way.
    return report.errors, report.warnings, sizing


def _inside(path: Any, directory: Any) -> bool:
    """`path` is `directory` or lies in it (s3:// URLs alike: normpath treats both sides the same way)."""
    if not isinstance(path, str) or not isinstance(directory, str) or not path or not directory:
        return False
    path, directory = os.path.normpath(path), os.path.normpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _prepares_inputs(preparation: dict[str, Any], inputs: StageInputs) -> bool:
    """Whether this launch's data_preparation writes some of the fine-tuning inputs: a chat (or preference) file or
    the tokenizer lies in its output_dir (data_preparation=sft_demo and preference_demo write both). Otherwise each
    is looked for as usual."""
    return any(_inside(path, preparation.get("output_dir")) for path in (inputs.tokenizer, *inputs.record_files))


def _restores_from(cfg: LaunchConfig, stage: str, path: Any) -> bool:
    """model.restore_from_path names the checkpoints of this launch's `stage` (the directory, or one step in it)."""
    if stage not in cfg.sections:
        return False
    directory = cfg.stage(stage).inputs.checkpoint_dir or f"{cfg.stage(stage).run.results_dir}/checkpoints"
    return _inside(path, str(directory))


def _top_level(cfg: LaunchConfig) -> list[str]:
    errors = []
    stages = list(cfg.stages)
    for stage in stages:
        if stage not in STAGES:
            errors.append(f"stages: unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")
        elif importlib.util.find_spec(PROGRAMS[stage]) is None:
            errors.append(
                f"stages: {stage!r} needs {PROGRAMS[stage]}, which this version does not have yet; "
                "leave it out of stages"
            )
    if len(set(stages)) != len(stages):
        errors.append(f"stages: {stages} names a stage twice; list each stage once")
    if cfg.cluster_type not in CLUSTER_TYPES:
        errors.append(f"cluster_type: {cfg.cluster_type!r} is not one of {', '.join(CLUSTER_TYPES)}")
    if problem := rules.run_name(cfg.run_name, _run_name_key(cfg)):
        errors.append(problem)
    for key, value in (("base_results_dir", str(cfg.base_results_dir or "")), ("data_dir", str(cfg.data_dir or ""))):
        if key == "data_dir" and value.startswith("s3://"):
            continue  # staged to cluster.staging.local_dir; staging.problems checks it
        if not value.startswith("/") or rules.unsafe_path(value):
            errors.append(
                f"{key}: {value!r} must be an absolute path without spaces, quotes or backslashes; "
                f"e.g. {key}=/fsx/{key}"
            )
        elif key == "base_results_dir" and (problem := rules.slurm_pattern(value, key)):
            errors.append(problem)  # every stage's logs are under it, in #SBATCH --output
    errors += _env_vars(cfg.env_vars, "env_vars")
    return errors


def _too_long_paths(cfg: LaunchConfig) -> list[str]:
    """rules.path_length on base_results_dir, data_dir and each stage's results directory, and a trainer stage's
    checkpoint directory and tokenizer: a path inside a refused one is not named again."""
    errors, refused = [], []
    for key, value in (("base_results_dir", cfg.base_results_dir), ("data_dir", cfg.data_dir)):
        if value and (problem := rules.path_length(str(value), key)):
            errors.append(problem)
            refused.append(str(value))
    for stage in (s for s in cfg.stages if s in cfg.sections):
        section = cfg.stage(stage).section
        if stage in TRAINER_STAGES:
            errors += too_long_paths(section, f"{stage}.", tuple(refused))
            continue
        results_dir = str(cfg.stage(stage).run.results_dir or "")
        if not results_dir.startswith(tuple(refused)) and \
                (problem := rules.path_length(results_dir, f"{stage}.run.results_dir")):
            errors.append(problem)
    return errors


def _run_name_key(cfg: LaunchConfig) -> str:
    """run_name defaults to ${trained:run.name}, the run name of the launch's last trainer stage: name the key the
    user most likely typed."""
    for stage in [*(s for s in reversed(cfg.stages) if s in TRAINER_STAGES), "training"]:
        if stage in cfg.sections and cfg.stage(stage).run.name == cfg.run_name:
            return f"{stage}.run.name"
    return "run_name"


def _env_vars(env: Any, key: str) -> list[str]:
    if env is None:
        return []
    if not isinstance(env, dict):
        return [f"{key}: must be a mapping of NAME: value, e.g. {key}.NCCL_DEBUG=INFO"]
    return [
        f"{key}.{name}: {name!r} is not a valid environment variable name (letters, digits, _)"
        for name in env
        if not _ENV_NAME.match(str(name))
    ]


def _stage_run(run: Run, stage: str) -> list[str]:
    errors = []
    if problem := rules.time_limit(run.time_limit, f"{stage}."):
        errors.append(problem)
    if problem := rules.results_dir(run.results_dir, f"{stage}."):
        errors.append(problem)
    dependency = run.dependency or choices.DEFAULT_DEPENDENCY
    if problem := choices.DEPENDENCIES.problem(f"{stage}.run.dependency", dependency):
        errors.append(problem)
    return errors


def _results_dir_pattern(run: Run, stage: str, cfg: LaunchConfig) -> list[str]:
    """A stage's logs are in <run.results_dir>/logs, named in #SBATCH --output. A '%' that comes from
    base_results_dir or run_name is reported once, under that key."""
    value = str(run.results_dir or "")
    inherited = "%" in str(cfg.base_results_dir) or "%" in str(cfg.run_name)
    problem = None if inherited else rules.slurm_pattern(value, f"{stage}.run.results_dir")
    return [problem] if problem else []


def training(stage: dict[str, Any], *, vocab_size: int | None = None) -> list[str]:
    """The schema's errors for a training config that is not launched (estimate, autoconfig): no file checks."""
    return parse_training(stage, files="skip", vocab_size=vocab_size)[1].errors


def _data_preparation(stage: dict[str, Any], *, dry_run: bool) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the data stage. A mistake in the config is an error always; what check_inputs finds
    beyond that is about the disk (input files, globs, tokenizer paths), which a dry run rendering for a cluster's
    file system often cannot see: warnings there, errors at launch, as for the training stage's files."""
    from runtime.data_prep.plan import check_inputs, parse_config  # torch-free by contract
    from runtime.schema.data_preparation import UserError as StageError

    try:
        parse_config(stage)
    except StageError as error:
        return list(error.problems), []
    # check_inputs names keys within the stage (input.files[0]); the launch names them from the root.
    found = [p if p.startswith("data_preparation.") else f"data_preparation.{p}" for p in check_inputs(stage)]
    return ([], found) if dry_run else (found, [])


def inputs_unseen(stage: dict[str, Any]) -> bool:
    """Whether some input file of a data stage is not on this machine, so that its array cannot be sized by
    counting files here (a dry run for a cluster's file system sizes it by the entries the config names)."""
    from runtime.data_prep.plan import expand_files, parse_config  # torch-free by contract
    from runtime.schema.data_preparation import UserError as StageError

    try:
        cfg = parse_config(stage)
        if cfg.input.source != "files":
            return False
        missing: list[str] = []
        expand_files(cfg.input.files, cfg.input.file_numbers, "input.files", missing)
    except StageError:
        return True  # file_numbers past the files found here: not countable here either
    return bool(missing)


def _nodes(value: Any) -> list[str]:
    """A node list as written (a list, or one hostlist string), every node named; [] where it is unreadable."""
    try:
        items = value if isinstance(value, list) else split_hostlist(value) if isinstance(value, str) else []
        return [node for item in items for node in expand_hostlist(str(item))]
    except ValueError:
        return []


def slurm_recovery_only(jobs, executor: str) -> list[str]:
    """Spare nodes, peer-held state and elastic shrinking are what the Slurm job script does after a failure; no
    other executor restarts a run in place, so a key asking for them is refused there, not dropped."""
    errors = []
    for job in jobs:
        asked = [key for key, on in (("fault_tolerance.spare_nodes", job.spare_nodes),
                                     ("fault_tolerance.peer_state_every_n_steps", job.peer_state_every),
                                     ("run.elastic", job.elastic)) if on]
        errors += [f"{job.stage}.{key}: only the Slurm job script recovers in place (spare nodes, peer-held state, "
                   f"elastic data parallelism); the {executor} executor cannot: unset it or use cluster_type=slurm"
                   for key in asked]
    return errors


def excluded_every_node(section: Cluster, nodes_needed: int, *, ask_slurm: bool) -> list[str]:
    """cluster.exclude leaving fewer nodes than the largest job needs: of cluster.nodelist, and (`ask_slurm`, a real
    launch where sinfo answers) of the partition. A job that can never start would wait in the queue for ever."""
    excluded = set(_nodes(section.exclude))
    if not excluded:
        return []
    candidates, where = _nodes(section.nodelist), "cluster.nodelist"
    if not candidates and ask_slurm:
        candidates = partition_nodes(section.partition)
        where = f"partition {section.partition}" if section.partition else "the cluster"
    if not candidates:
        return []
    left = [node for node in candidates if node not in excluded]
    if len(left) >= nodes_needed:
        return []
    return [f"cluster.exclude: leaves {len(left)} of the {len(candidates)} nodes of {where} "
            f"({', '.join(left) or 'none'}) for a job of {nodes_needed} node(s); exclude fewer nodes"]


def _hostlist(value: Any, key: str) -> list[str]:
    """A list of nodes, or one Slurm hostlist string ('node[1-8]', 'node[01-03,7]', 'a,b'), which sbatch and
    cluster-validate read as it is: one error line per entry Slurm would not read."""
    if value is None or value == []:
        return []
    if isinstance(value, str):
        try:
            split_hostlist(value)
        except ValueError as error:
            return [f"{key}: {error}; give a list ({key}=[node1,node2]) or one Slurm hostlist, quoted for Hydra: "
                    f"\"{key}='node[1-8]'\""]
        value = [value]
    if not isinstance(value, list):
        return [f"{key}: {value!r} must be a list of nodes or a Slurm hostlist, e.g. {key}=[node1,node2]"]
    errors = []
    for item in value:
        try:
            expand_hostlist(str(item))
        except ValueError as error:
            errors.append(f"{key}: {error}")
    return errors


def node_memory(section: Cluster) -> list[str]:
    """cluster.node_memory_gib: null or a positive number (nxdt-launch estimate checks it too)."""
    if section.node_memory_gib is not None and section.node_memory_bytes is None:
        example = INSTANCES["trn1.32xlarge"]
        return [f"cluster.node_memory_gib: {section.node_memory_gib!r} must be a positive number, the host memory of "
                f"one node in GiB (e.g. {example.host_memory_gib} for {example.name}), or null for the instance's"]
    return []


def cluster(section: Cluster) -> list[str]:
    errors = []
    known = SBATCH_KEYS + OTHER_CLUSTER_KEYS
    for key in section.keys:
        if key not in known:
            errors.append(f"cluster.{key}: unknown key; valid keys: {', '.join(known)}")
    for key in SBATCH_KEYS:
        value = section.sbatch.get(key)
        values = value if isinstance(value, list) else [] if value is None or isinstance(value, bool) else [value]
        for item in values:
            if not _SBATCH_VALUE.match(str(item)):
                errors.append(
                    f"cluster.{key}: {item!r} is not a Slurm value (letters, digits and _.,:@%+=/[]- only)"
                )
    for key, value in (("srun_args", section.srun_args), ("setup", section.setup)):
        if not isinstance(value, list):
            errors.append(f"cluster.{key}: must be a list, e.g. cluster.{key}=[a,b]")
    for key in ("nodelist", "exclude"):
        errors += _hostlist(section.sbatch.get(key), f"cluster.{key}")
    errors += _env_vars(section.env_vars, "cluster.env_vars")
    if section.hyperpod not in (None, True, False):
        errors.append(f"cluster.hyperpod: {section.hyperpod!r} must be true (SageMaker HyperPod's Slurm: "
                      "srun --auto-resume=1) or false")
    errors += node_memory(section)
    if section.venv is not None and not str(section.venv).startswith("/"):
        errors.append(f"cluster.venv: {section.venv!r} must be the absolute path of a venv on every node, "
                      "e.g. cluster.venv=/opt/nxdt/venv")
    # The nodes read cluster.s3 back through the same parser (runtime/io/s3.py).
    errors += parse_s3(section.s3)[1].errors
    return errors
