"""Python packages a launch asks of the job's interpreter, looked for before anything is written.

The stage programs import their packages when they need them (torch at start, wandb when the first metrics are
logged, zstandard at the first .zst file), so a missing one would fail the job minutes or hours in. The launcher
can look only where the job's interpreter is its own: `python` unset (or this interpreter), no container, no
remote head node. That covers the local executor, and Slurm from a head node whose venv the nodes share (how
docs/parallelcluster.md installs it). Elsewhere the job finds out itself.

Modules are looked up with importlib.util.find_spec, which imports nothing (the launcher never imports torch).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from launcher.config import LaunchConfig
from runtime.schema.stages import FINE_TUNING_STAGES, STAGE_PROGRAMS, TITAN_PROGRAM

RUNTIME = ("the runtime extra: python3 -m pip install torch==2.13.0 'nxdt-launch[runtime]' "
           "(-c constraints.txt -e '.[runtime]' in a checkout)")

TORCHTITAN = ("the torchtitan extra: python3 -m pip install 'nxdt-launch[torchtitan]' (-e '.[torchtitan]' in a "
              "checkout), or set training.runtime=nxdt")

EVAL = ("the eval extra: python3 -m pip install 'nxdt-launch[runtime,eval]' (-e '.[runtime,eval]' in a checkout), "
        "or keep to the loss and exact_match tasks")

# What each stage's program imports whatever its config says (runtime/schema/stages.py names the program); the
# fine-tuning stages also render chat templates.
PROGRAM_MODULES = {
    "runtime.data_prep": ("numpy", "tokenizers"),
    "runtime.train": ("torch", "numpy", "tokenizers"),
    "runtime.convert": ("torch", "safetensors"),
    "runtime.evaluate": ("torch", "tokenizers"),
    # training.runtime=torchtitan (launcher/titan.py); torchtitan's model package imports triton, which CUDA torch
    # ships and CPU torch does not (the torchtitan extra installs it).
    TITAN_PROGRAM: ("torch", "torchtitan", "triton"),
}
STAGE_MODULES = {stage: PROGRAM_MODULES[program] + (("jinja2",) if stage in FINE_TUNING_STAGES else ())
                 for stage, program in STAGE_PROGRAMS.items()}


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module set to None in sys.modules
        return False


def job_python_is_ours(cfg: LaunchConfig) -> bool:
    """Whether the job scripts run this very interpreter (render.python decides which one they run: a container's,
    a cluster venv's, a remote head node's or this one): only then does what is installed here tell anything."""
    from launcher.render import python  # render imports most of the launcher; this check runs once per launch

    return Path(python(cfg)).resolve() == Path(sys.executable).resolve()


def needed(cfg: LaunchConfig) -> list[tuple[str, str, str]]:
    """(module, the key or stage that needs it, how to get it) for every stage this launch runs."""
    from launcher.stages import runs_torchtitan

    wants: list[tuple[str, str, str]] = []
    titan = "training" in cfg.stages and "training" in cfg.sections and \
        runs_torchtitan(cfg.stage("training").section)
    for stage in cfg.stages:
        if stage == "training" and titan:  # torchtitan's job: its program's packages, none of our loggers'
            wants += [(module, "training.runtime: torchtitan", TORCHTITAN) for module in PROGRAM_MODULES[TITAN_PROGRAM]]
            continue
        wants += [(module, f"stages: {stage}", RUNTIME) for module in STAGE_MODULES.get(stage, ())]
    if "training" in cfg.stages and not titan:
        inputs = cfg.stage("training").inputs
        key = "training.exp_manager."
        if inputs.wandb:
            wants.append(("wandb", f"{key}create_wandb_logger: true",
                          f"pip install wandb, or set {key}create_wandb_logger=false"))
        if inputs.tensorboard:
            wants.append(("tensorboard", f"{key}create_tensorboard_logger: true",
                          f"{RUNTIME}; or set {key}create_tensorboard_logger=false"))
    if "data_preparation" in cfg.stages:
        wants += _data_preparation(cfg.stage("data_preparation").section)
    evaluation = cfg.stage("evaluation").evaluation if "evaluation" in cfg.stages else None
    scored_by_lm_eval = [spec.name for spec in (evaluation.tasks if evaluation else ())
                         if spec.type not in ("loss", "exact_match")]
    if scored_by_lm_eval:
        wants.append(("lm_eval", f"evaluation.tasks: {scored_by_lm_eval[0]} (scored by lm-evaluation-harness)",
                      EVAL))
    return wants


def _data_preparation(stage_cfg: dict) -> list[tuple[str, str, str]]:
    """Readers and tokenizer libraries its inputs call for; nothing when the inputs cannot be listed here (on S3,
    or a config the schema refuses: validation reports those)."""
    from runtime.data_prep.plan import build_shards  # torch-free by contract
    from runtime.schema.data_preparation import UserError, parse_config

    try:
        cfg = parse_config(stage_cfg)
        shards = [] if cfg.input.source == "demo" else build_shards(cfg)
    except (UserError, ValueError, OSError):
        return []
    wants = []
    if cfg.tokenizer.library == "sentencepiece":
        wants.append(("sentencepiece", "data_preparation.tokenizer.library: sentencepiece",
                      f"{RUNTIME}; or use a huggingface tokenizer.json"))
    readers = {".zst": ("zstandard", RUNTIME), ".parquet": ("pyarrow", "pip install 'nxdt-launch[parquet]'")}
    for suffix, (module, fix) in readers.items():
        first = next((s.location for s in shards if s.location.endswith(suffix)), None)  # one line per package
        if first is not None:
            wants.append((module, f"data_preparation.input: {first} ({suffix})", fix))
    return wants


def problems(cfg: LaunchConfig) -> list[str]:
    """One line per package the job's interpreter lacks; [] when it is not this interpreter (see the top)."""
    if not job_python_is_ours(cfg):
        return []
    missing, seen = [], set()
    for module, why, fix in needed(cfg):
        if module in seen or importable(module):
            continue
        seen.add(module)
        missing.append(f"{why} needs the {module} package, which {sys.executable} (the jobs' Python) cannot "
                       f"import; install it: {fix}")
    return missing
