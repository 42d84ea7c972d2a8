"""S3 data: `data_dir` (and the data-preparation inputs) may be s3:// URLs. The launcher rewrites each such URL in
the stage configs to its mirror on the shared file system, `<cluster.staging.local_dir>/<bucket>/<key>`, and
writes a manifest next to the stage config (runtime/io/manifest.py); the job script then runs
`python -m runtime.io.staging pull` before the program and `push` after it succeeds. Nothing is fetched when the
launcher renders (a dry run stays offline): this module only plans; the node moves the data, with the S3 client
settings of cluster.s3.

Which keys move data, per stage (anything else that is s3:// is refused, naming these):

| stage            | pulled before the program                                  | pushed after it | mirrored only (scratch) |
| ---------------- | ---------------------------------------------------------- | --------------- | ----------------------- |
| data_preparation | input.files, tokenizer.{model,vocab_file,merge_file}, tokenizer.train.files | output_dir | download.dir |
| training         | model.tokenizer.model, model.data.data_prefix (blend file or prefixes) | -   | model.data.index_mapping_dir |
| fine_tuning, peft, alignment, rlhf_rm, rl | model.tokenizer.model, model.data.{train_ds,validation_ds}.file_names | - | -   |
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config import FINE_TUNING_STAGES, LaunchConfig, parse, typed
from runtime.io.manifest import BLEND, INDEXED, OBJECT, PUSH_TREE, mirror
from runtime.io.s3 import is_s3
from runtime.schema import rules
from runtime.schema.reader import Report, Section
from runtime.schema.s3 import KEYS as S3_KEYS

_GLOB = re.compile(r"[*?\[]")


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


# (dotted key in the stage config, kind); list values yield one entry per element.
PULLS = {
    "data_preparation": [("input.files", OBJECT), ("tokenizer.model", OBJECT), ("tokenizer.vocab_file", OBJECT),
                         ("tokenizer.merge_file", OBJECT), ("tokenizer.train.files", OBJECT)],
    "training": [("model.tokenizer.model", OBJECT), ("model.data.data_prefix", None)],
    # Fine-tuning's chat files (alignment's preference files) and tokenizer are staged like training's; starting
    # weights on S3 are a checkpoint of ours (read from S3 directly, NATIVE below).
    **{stage: [("model.tokenizer.model", OBJECT), ("model.data.train_ds.file_names", OBJECT),
               ("model.data.validation_ds.file_names", OBJECT)] for stage in FINE_TUNING_STAGES},
    "conversion": [("tokenizer_model", OBJECT)],
    "evaluation": [("tokenizer_model", OBJECT)],
}
PUSHES = {"data_preparation": ["output_dir"]}
SCRATCH = {"data_preparation": ["download.dir"], "training": ["model.data.index_mapping_dir"]}
# Keys (and everything under them) whose program reads S3 itself, or reports it cannot: never staged or localized.
# Checkpoints go to S3 directly (runtime/checkpoint/storage.py); evaluation task files are local by contract.
NATIVE = {"training": ["exp_manager.checkpoint_callback_params.dirpath", "exp_manager.resume_from_checkpoint"],
          **{stage: ["exp_manager.checkpoint_callback_params.dirpath", "exp_manager.resume_from_checkpoint",
                     "model.restore_from_path"] for stage in FINE_TUNING_STAGES},
          "conversion": ["checkpoint_dir", "hf_checkpoint_dir"], "evaluation": ["checkpoint_dir", "tasks"]}


def _is_native(stage: str, key: str) -> bool:
    return any(key == n or key.startswith((n + ".", n + "[")) for n in NATIVE.get(stage, []))


def _staged_s3_values(stage: str, stage_cfg: dict[str, Any]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in s3_values(stage_cfg) if not _is_native(stage, k)]


@dataclass(frozen=True)
class StagePlan:
    """What one stage's job moves between S3 and the shared file system."""

    manifest_path: Path
    local_dir: str
    pulls: list[dict[str, str]] = field(default_factory=list)
    pushes: list[dict[str, str]] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        return {"local_dir": self.local_dir, "pulls": self.pulls, "pushes": self.pushes}


def s3_values(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Every (dotted key, value) under node whose value is an s3:// string."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            found += s3_values(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += s3_values(v, f"{prefix}[{i}]")
    elif is_s3(node):
        found.append((prefix, node))
    return found


def _pull_entries(key: str, kind: str | None, value: Any, root: str) -> list[dict[str, str]]:
    values = value if isinstance(value, list) else [value]
    if key == "model.data.data_prefix":
        if isinstance(value, str):  # the path of a blend file
            return [{"key": key, "url": value, "local": mirror(value, root), "kind": BLEND}] if is_s3(value) else []
        values = value[1::2]        # [weight, prefix, weight, prefix, ...]
        kind = INDEXED
    return [{"key": key, "url": v, "local": mirror(v, root), "kind": kind} for v in values if is_s3(v)]


def stage_plan(stage: str, cfg: LaunchConfig, manifest_path: Path) -> StagePlan | None:
    """The transfers of one stage of the resolved (not yet localized) config; None when it has none."""
    stage_cfg = cfg.sections[stage].section if stage in cfg.sections else {}
    if not _staged_s3_values(stage, stage_cfg):
        return None
    root = str(cfg.cluster.staging_local_dir)
    pulls = [entry for key, kind in PULLS.get(stage, [])
             for entry in _pull_entries(key, kind, input_files(stage_cfg) if key == "input.files" else
                                        _get(stage_cfg, key), root)]
    pushes = [{"key": key, "local": mirror(_get(stage_cfg, key), root), "url": _get(stage_cfg, key),
               "kind": PUSH_TREE} for key in PUSHES.get(stage, []) if is_s3(_get(stage_cfg, key))]
    return StagePlan(manifest_path, root, pulls, pushes)


def for_job(job, cfg: LaunchConfig | dict[str, Any]) -> StagePlan | None:
    """The plan of a Job's stage, its manifest written next to the stage config."""
    return stage_plan(job.stage, typed(cfg), job.results_dir / f"{job.stage}_staging.json")


def localize(cfg: LaunchConfig) -> LaunchConfig:
    """The config with every s3:// URL replaced by its mirror under cluster.staging.local_dir: what the
    programs read. Unchanged when nothing is on S3."""
    root = cfg.cluster.staging_local_dir
    if not root:
        return cfg

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path) for v in node]
        stage, _, key = path.partition(".")
        return mirror(node, root) if is_s3(node) and not _is_native(stage, key) else node

    return parse(walk(cfg.raw, ""))


def has_s3_inputs(stage_cfg: dict[str, Any]) -> bool:
    """Data preparation reads its input files from S3: they can only be checked (and counted) by name."""
    return any(is_s3(f) for f in (_get(stage_cfg, "input.files") or []))


def input_files(stage_cfg: dict[str, Any]) -> list[str]:
    """data_preparation's input.files as the runtime's planner orders them, from the config alone (nothing is
    listed): {} patterns filled from input.file_numbers, or the numbered entries picked; duplicates dropped."""
    from runtime.data_prep.plan import parse_file_numbers  # torch-free by contract

    files = [str(f) for f in _get(stage_cfg, "input.files") or []]
    spec = _get(stage_cfg, "input.file_numbers")
    numbers = parse_file_numbers(spec) if spec is not None else []
    if any("{" in f for f in files):
        files = [g for f in files for g in ([f.format(n) for n in numbers] if "{" in f else [f])]
    elif spec is not None:
        files = [files[n] for n in numbers if n < len(files)]
    return list(dict.fromkeys(files))


def count_input_files(stage_cfg: dict[str, Any]) -> int:
    """The array size of a data preparation whose inputs are on S3: one task per file, as the runtime counts."""
    limit = int(stage_cfg.get("max_array_tasks") or 1000)
    return max(1, min(len(input_files(stage_cfg)), limit))


def problems(cfg: LaunchConfig) -> list[str]:
    """s3:// values the launcher cannot stage, one line each. Pure: nothing is contacted."""
    report = Report()
    section = Section(cfg.cluster.staging, "cluster.staging", report)
    root = section.str("local_dir", None)
    moved = sorted(set(section.data) & set(S3_KEYS))  # a cluster file written before cluster.s3 existed
    for key in moved:
        report.error(f"cluster.staging.{key}: moved to cluster.s3.{key}, which every S3 client reads (staging, "
                     "checkpoints); set it there")
    if not moved:
        section.done()
    errors = report.errors
    stages = [s for s in cfg.stages if s in cfg.sections]
    found = [("data_dir", cfg.data_dir)] if is_s3(cfg.data_dir) else []
    found += [(f"{s}.{k}", v) for s in stages for k, v in _staged_s3_values(s, cfg.stage(s).section)]
    if not found:
        return errors
    if not root or not root.startswith("/"):
        errors.append(f"cluster.staging.local_dir: {root!r}; {found[0][0]} is on S3 ({found[0][1]}), so give "
                      "the absolute directory on the shared file system it is copied to, e.g. "
                      "cluster.staging.local_dir=/fsx/staging")
    for stage in stages:
        known = {k for k, _ in PULLS.get(stage, [])} | set(PUSHES.get(stage, [])) | set(SCRATCH.get(stage, []))
        for key, value in _staged_s3_values(stage, cfg.stage(stage).section):
            base = re.sub(r"\[\d+\]$", "", key)
            if base not in known:
                where = ", ".join(sorted(known)) or "none"
                errors.append(f"{stage}.{key}: {value} is on S3, but this stage stages only {where}; "
                              "use a path on the shared file system")
            elif _GLOB.search(value) or "{" in value and base != "input.files":
                errors.append(f"{stage}.{key}: {value}: S3 URLs cannot hold wildcards (nothing is listed at "
                              "launch); name each object, or use a {:02d} pattern with input.file_numbers")
            elif problem := rules.s3_uri(value, f"{stage}.{key}", patterns=base == "input.files"):
                errors.append(problem)
    return errors
