# The resolved `cluster_validation` config group as small typed dataclasses. Torch-free: the launcher parses it
# before anything is written, so a mistake is one `error:` line naming the key; the node agent parses the same
# YAML again on every node.
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from csp_tools.cluster_validate.bandwidth import DTYPES, OPERATIONS
from runtime.schema import choices
from runtime.schema.reader import Choices, Report, Section

# trainer.accelerator (runtime/schema/choices.py) -> torch.distributed backend
ACCELERATORS = {"cpu": "gloo", "gpu": "nccl", "neuron": "xla"}
assert set(ACCELERATORS) == set(choices.ACCELERATORS), "a backend for every accelerator the schema accepts"
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """One or more problems with the config; each names the key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def parse_size(value: Any) -> int:
    """8, "1K", "16M", "1G" (powers of 1024, as nccl-tests' -b/-e take them) -> bytes."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(value)
    return int(match.group(1)) * 1024 ** "_KMGT".index((match.group(2) or "_").upper())


@dataclass(frozen=True)
class HealthConfig:
    paths: tuple[str, ...]            # free space + write/read round trip on each (results and data directories)
    shared_paths: tuple[str, ...]     # must show node 0's marker file at the same path on every node
    min_free_gib: float
    min_available_memory_gib: float
    max_clock_skew_s: float
    python_packages: tuple[str, ...]  # versions compared across nodes
    system_packages: tuple[str, ...]  # dpkg/rpm packages compared across nodes (the Neuron driver and runtime)
    timeout_s: float


@dataclass(frozen=True)
class CollectiveConfig:
    operations: tuple[str, ...]
    min_bytes: int
    max_bytes: int
    step_factor: int
    warmup_iters: int
    iters: int
    dtype: str
    check: bool
    timeout_s: float                  # one collective; beyond it the test fails instead of hanging


@dataclass(frozen=True)
class SweepConfig:
    operation: str                    # the operation whose busbw judges a node, group or pair
    judge_bytes: int                  # ... at this size (the largest swept size not above it)
    pair_operations: tuple[str, ...]  # what pair rounds run (the all-nodes test runs collectives.operations)
    outlier_fraction: float           # fail below this fraction of the median of the node's peers
    max_rounds: int
    intra_node: bool                  # torch collectives within each node (when devices > 1)
    all_nodes: bool                   # finish with one test over every good node (bisected when it fails)


@dataclass(frozen=True)
class Floors:
    """Absolute busbw floors (GB/s) of sweep.operation; applied only when the judged size reaches at_bytes."""

    intra_node: float | None = None
    pair: float | None = None
    all_nodes: float | None = None
    at_bytes: int = 0


@dataclass(frozen=True)
class Expected:
    neuron_devices: int | None = None
    neuron_cores: int | None = None
    gpus: int | None = None
    efa_devices: int | None = None
    host_memory_gib: float | None = None


@dataclass(frozen=True)
class NccomConfig:
    enabled: str                      # auto | true | false
    operations: dict[str, str]        # our operation name -> nccom-test's
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class ValidationConfig:
    results_dir: str
    accelerator: str
    devices: int
    instance_type: str                # auto, or e.g. trn1.32xlarge
    port: int | None
    register_timeout_s: float
    task_timeout_s: float
    health: HealthConfig
    collectives: CollectiveConfig
    sweep: SweepConfig
    nccom_test: NccomConfig
    expected: dict[str, Expected]
    thresholds: dict[str, Floors]
    cluster_exclude: tuple[str, ...]  # nodes the launch already excluded: kept in the override we write

    @property
    def backend(self) -> str:
        return ACCELERATORS[self.accelerator]

    def expected_for(self, instance_type: str) -> Expected:
        return self.expected.get(type_key(instance_type), Expected())

    def floors_for(self, instance_type: str) -> Floors:
        return self.thresholds.get(type_key(instance_type)) or self.thresholds.get("default") or Floors()


def type_key(instance_type: str) -> str:
    """trn1.32xlarge -> trn1_32xlarge: the config keys instance types this way because Hydra overrides split
    keys at dots (`thresholds.trn1_32xlarge.pair=30`)."""
    return instance_type.replace(".", "_")


def _size(s: Section, name: str, default: Any) -> int | None:
    value = s.raw(name, default)
    try:
        size = parse_size(value)
    except ValueError:
        s.report.error(f"{s.key(name)}: {value!r} is not a size; use bytes or 64K, 16M, 1G")
        return None
    if size < 1:
        s.report.error(f"{s.key(name)}: must be at least 1 byte")
        return None
    return size


def _list(s: Section, name: str) -> tuple[str, ...] | None:
    value = s.raw(name, [])
    if not isinstance(value, list):
        s.report.error(f"{s.key(name)}: must be a list, e.g. {s.key(name)}=[a,b]")
        return None
    return tuple(str(v) for v in value)


def _operations(s: Section, name: str, default: tuple) -> tuple[str, ...] | None:
    ops = _list(s, name) if s.has(name) else tuple(default)
    if ops is None:
        return None
    for op in ops:
        if op not in OPERATIONS:
            s.report.error(f"{s.key(name)}: unknown operation {op!r}; valid: {', '.join(OPERATIONS)}")
    if not ops:
        s.report.error(f"{s.key(name)}: name at least one operation ({', '.join(OPERATIONS)})")
    return tuple(op for op in ops if op in OPERATIONS)


def _expected(reader: Section) -> dict[str, Expected]:
    table = {}
    for instance_type in reader.data:
        entry = reader.section(str(instance_type))
        table[type_key(str(instance_type))] = Expected(
            **{key: entry.float(key, None, minimum=0.0) for key in Expected.__dataclass_fields__}
        )
    return table


def _thresholds(reader: Section) -> dict[str, Floors]:
    table = {}
    for instance_type in reader.data:
        entry = reader.section(str(instance_type))
        floors = {key: entry.float(key, None, minimum=0.0) for key in ("intra_node", "pair", "all_nodes")}
        at_bytes = _size(entry, "at_bytes", 1) if entry.raw("at_bytes", None) not in (None, 0) else 0
        table[type_key(str(instance_type))] = Floors(**floors, at_bytes=at_bytes or 0)
    return table


def parse(raw: Any, *, prefix: str = "cluster_validation", cluster_exclude: Any = ()) -> ValidationConfig:
    """The typed config, or ConfigError listing every problem (each naming its key). Read with the schema's one
    reader (runtime/schema/reader.py), so messages read as every other stage's."""
    report = Report()
    top = Section(raw, prefix, report)
    run = top.section("run")
    accelerator = top.choice("accelerator", choices.ACCELERATORS, "cpu")
    port = top.int("port", None, minimum=1)
    if port is not None and port > 65535:
        report.error(f"{prefix}.port: {port} is above 65535")

    h = top.section("health")
    health = dict(
        paths=_list(h, "paths"), shared_paths=_list(h, "shared_paths"),
        min_free_gib=h.float("min_free_gib", 1, minimum=0.0),
        min_available_memory_gib=h.float("min_available_memory_gib", 1, minimum=0.0),
        max_clock_skew_s=h.float("max_clock_skew_s", 1.0, minimum=0.0), python_packages=_list(h, "python_packages"),
        system_packages=_list(h, "system_packages"), timeout_s=h.float("timeout_s", 120, minimum=1),
    )

    c = top.section("collectives")
    collectives = dict(
        operations=_operations(c, "operations", OPERATIONS), min_bytes=_size(c, "min_bytes", "1K"),
        max_bytes=_size(c, "max_bytes", "4M"), step_factor=c.int("step_factor", 4, minimum=2),
        warmup_iters=c.int("warmup_iters", 5, minimum=0), iters=c.int("iters", 20, minimum=1),
        dtype=c.choice("dtype", Choices(DTYPES), "float32"), check=c.bool("check", True),
        timeout_s=c.float("timeout_s", 120, minimum=1),
    )
    if None not in (collectives["min_bytes"], collectives["max_bytes"]) and \
            collectives["min_bytes"] > collectives["max_bytes"]:
        report.error(f"{c.key('min_bytes')}: {collectives['min_bytes']} is above max_bytes {collectives['max_bytes']}")

    s = top.section("sweep")
    operation = s.choice("operation", Choices(OPERATIONS), "all_reduce")
    judge = s.raw("judge_bytes", None)
    sweep = dict(
        operation=operation,
        judge_bytes=collectives["max_bytes"] if judge is None else _size(s, "judge_bytes", None),
        pair_operations=_operations(s, "pair_operations", (operation,)),
        outlier_fraction=s.float("outlier_fraction", 0.7, minimum=0.0),
        max_rounds=s.int("max_rounds", 12, minimum=1),
        intra_node=s.bool("intra_node", True), all_nodes=s.bool("all_nodes", True),
    )
    if sweep["outlier_fraction"] is not None and sweep["outlier_fraction"] > 1:
        report.error(f"{s.key('outlier_fraction')}: {sweep['outlier_fraction']} must be between 0 and 1")
    if operation and sweep["pair_operations"] is not None and operation not in sweep["pair_operations"]:
        report.error(f"{s.key('pair_operations')}: must include sweep.operation {operation!r}")

    n = top.section("nccom_test")
    enabled = str(n.raw("enabled", "auto")).lower()
    if problem := Choices(("auto", "true", "false")).problem(n.key("enabled"), enabled):
        report.error(problem)
    ops = n.mapping("operations") or {}
    nccom = NccomConfig(enabled=enabled, operations={str(k): str(v) for k, v in ops.items()},
                        extra_args=_list(n, "extra_args") or ())

    results_dir = str(run.raw("results_dir", "") or "")
    if not results_dir.startswith("/"):
        report.error(f"{run.key('results_dir')}: {results_dir!r} must be an absolute path")
    values = dict(devices=top.int("devices", 1, minimum=1), register_timeout_s=top.float("register_timeout_s", 120,
                                                                                          minimum=1),
                  task_timeout_s=top.float("task_timeout_s", 600, minimum=1))
    expected, thresholds = _expected(top.section("expected")), _thresholds(top.section("thresholds"))
    if report.errors:
        raise ConfigError(report.errors)
    excluded = cluster_exclude if isinstance(cluster_exclude, (list, tuple)) else []
    return ValidationConfig(
        results_dir=results_dir, accelerator=accelerator, instance_type=str(top.raw("instance_type", "auto")),
        port=port, health=HealthConfig(**health), collectives=CollectiveConfig(**collectives),
        sweep=SweepConfig(**sweep), nccom_test=nccom, expected=expected, thresholds=thresholds,
        cluster_exclude=tuple(str(x) for x in excluded), **values,
    )


def load(path: str) -> ValidationConfig:
    """The file the launcher wrote (`cluster_validation_config.yaml`): the group plus `launch:` facts."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    return parse(raw, cluster_exclude=(raw.get("launch") or {}).get("cluster_exclude") or ())
