# The resolved `cluster_validation` config group as small typed dataclasses. Torch-free: the launcher parses it
# before anything is written, so a mistake is one `error:` line naming the key; the node agent parses the same
# YAML again on every node.
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from csp_tools.cluster_validate.bandwidth import DTYPES, OPERATIONS
from runtime.schema import choices

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


class _Reader:
    """Reads one mapping, collecting every problem instead of stopping at the first."""

    def __init__(self, data: Any, path: str, problems: list[str]):
        self.data = data if isinstance(data, dict) else {}
        self.path, self.problems = path, problems
        if not isinstance(data, dict):
            problems.append(f"{path}: must be a mapping")

    def key(self, name: str) -> str:
        return f"{self.path}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)

    def section(self, name: str) -> _Reader:
        return _Reader(self.data.get(name, {}), self.key(name), self.problems)

    def number(self, name: str, default: Any, *, minimum: float = 0.0, integer: bool = False, null: bool = False):
        value = self.data.get(name, default)
        if value is None and null:
            return None
        kind = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or value < minimum:
            what = "an integer" if integer else "a number"
            self.problems.append(f"{self.key(name)}: {value!r} must be {what} >= {minimum:g}"
                                 f"{' or null' if null else ''}, e.g. {self.key(name)}={default}")
            return default
        return value

    def size(self, name: str, default: Any) -> int:
        value = self.data.get(name, default)
        try:
            size = parse_size(value)
        except ValueError:
            self.problems.append(f"{self.key(name)}: {value!r} is not a size; use bytes or 64K, 16M, 1G")
            return parse_size(default)
        if size < 1:
            self.problems.append(f"{self.key(name)}: must be at least 1 byte")
        return size

    def strings(self, name: str, default: tuple = ()) -> tuple[str, ...]:
        value = self.data.get(name, list(default))
        if value is None:
            return ()
        if not isinstance(value, list):
            self.problems.append(f"{self.key(name)}: must be a list, e.g. {self.key(name)}=[a,b]")
            return tuple(default)
        return tuple(str(v) for v in value)

    def operations(self, name: str, default: tuple) -> tuple[str, ...]:
        ops = self.strings(name, default)
        for op in ops:
            if op not in OPERATIONS:
                self.problems.append(f"{self.key(name)}: unknown operation {op!r}; valid: {', '.join(OPERATIONS)}")
        if not ops:
            self.problems.append(f"{self.key(name)}: name at least one operation ({', '.join(OPERATIONS)})")
        return tuple(op for op in ops if op in OPERATIONS)


def _expected(reader: _Reader) -> dict[str, Expected]:
    table = {}
    for instance_type in reader.data:
        entry = reader.section(str(instance_type))
        table[type_key(str(instance_type))] = Expected(
            **{key: entry.number(key, None, null=True) for key in Expected.__dataclass_fields__}
        )
    return table


def _thresholds(reader: _Reader) -> dict[str, Floors]:
    table = {}
    for instance_type in reader.data:
        entry = reader.section(str(instance_type))
        floors = {key: entry.number(key, None, null=True) for key in ("intra_node", "pair", "all_nodes")}
        at_bytes = entry.size("at_bytes", 1) if entry.get("at_bytes") not in (None, 0) else 0
        table[type_key(str(instance_type))] = Floors(**floors, at_bytes=at_bytes)
    return table


def parse(raw: Any, *, prefix: str = "cluster_validation", cluster_exclude: Any = ()) -> ValidationConfig:
    """The typed config, or ConfigError listing every problem (each naming its key)."""
    problems: list[str] = []
    top = _Reader(raw, prefix, problems)
    run = top.section("run")
    accelerator = top.get("accelerator", "cpu")
    if problem := choices.ACCELERATORS.problem(f"{prefix}.accelerator", accelerator):
        problems.append(problem)
        accelerator = "cpu"
    port = top.number("port", None, minimum=1, integer=True, null=True)
    if port is not None and port > 65535:
        problems.append(f"{prefix}.port: {port} is above 65535")

    h = top.section("health")
    health = HealthConfig(
        paths=h.strings("paths"), shared_paths=h.strings("shared_paths"),
        min_free_gib=h.number("min_free_gib", 1), min_available_memory_gib=h.number("min_available_memory_gib", 1),
        max_clock_skew_s=h.number("max_clock_skew_s", 1.0), python_packages=h.strings("python_packages"),
        system_packages=h.strings("system_packages"), timeout_s=h.number("timeout_s", 120, minimum=1),
    )

    c = top.section("collectives")
    collectives = CollectiveConfig(
        operations=c.operations("operations", OPERATIONS), min_bytes=c.size("min_bytes", "1K"),
        max_bytes=c.size("max_bytes", "4M"), step_factor=c.number("step_factor", 4, minimum=2, integer=True),
        warmup_iters=c.number("warmup_iters", 5, integer=True), iters=c.number("iters", 20, minimum=1, integer=True),
        dtype=str(c.get("dtype", "float32")), check=bool(c.get("check", True)),
        timeout_s=c.number("timeout_s", 120, minimum=1),
    )
    if collectives.dtype not in DTYPES:
        problems.append(f"{c.key('dtype')}: {collectives.dtype!r} is not one of {', '.join(DTYPES)}")
    if collectives.min_bytes > collectives.max_bytes:
        problems.append(f"{c.key('min_bytes')}: {collectives.min_bytes} is above max_bytes {collectives.max_bytes}")

    s = top.section("sweep")
    operation = str(s.get("operation", "all_reduce"))
    if operation not in OPERATIONS:
        problems.append(f"{s.key('operation')}: unknown operation {operation!r}; valid: {', '.join(OPERATIONS)}")
    judge = s.get("judge_bytes")
    sweep = SweepConfig(
        operation=operation,
        judge_bytes=collectives.max_bytes if judge is None else s.size("judge_bytes", collectives.max_bytes),
        pair_operations=s.operations("pair_operations", (operation,)),
        outlier_fraction=s.number("outlier_fraction", 0.7),
        max_rounds=s.number("max_rounds", 12, minimum=1, integer=True),
        intra_node=bool(s.get("intra_node", True)), all_nodes=bool(s.get("all_nodes", True)),
    )
    if not 0 <= sweep.outlier_fraction <= 1:
        problems.append(f"{s.key('outlier_fraction')}: {sweep.outlier_fraction} must be between 0 and 1")
    if operation not in sweep.pair_operations:
        problems.append(f"{s.key('pair_operations')}: must include sweep.operation {operation!r}")

    n = top.section("nccom_test")
    enabled = str(n.get("enabled", "auto")).lower()
    if enabled not in ("auto", "true", "false"):
        problems.append(f"{n.key('enabled')}: {enabled!r} is not one of auto, true, false")
    ops = n.get("operations") or {}
    nccom = NccomConfig(enabled=enabled, operations={str(k): str(v) for k, v in ops.items()}
                        if isinstance(ops, dict) else {}, extra_args=n.strings("extra_args"))

    excluded = cluster_exclude if isinstance(cluster_exclude, (list, tuple)) else []
    config = ValidationConfig(
        results_dir=str(run.get("results_dir") or ""), accelerator=accelerator,
        devices=top.number("devices", 1, minimum=1, integer=True),
        instance_type=str(top.get("instance_type") or "auto"), port=port,
        register_timeout_s=top.number("register_timeout_s", 120, minimum=1),
        task_timeout_s=top.number("task_timeout_s", 600, minimum=1),
        health=health, collectives=collectives, sweep=sweep, nccom_test=nccom,
        expected=_expected(top.section("expected")), thresholds=_thresholds(top.section("thresholds")),
        cluster_exclude=tuple(str(x) for x in excluded),
    )
    if not config.results_dir.startswith("/"):
        problems.append(f"{run.key('results_dir')}: {config.results_dir!r} must be an absolute path")
    if problems:
        raise ConfigError(problems)
    return config


def load(path: str) -> ValidationConfig:
    """The file the launcher wrote (`cluster_validation_config.yaml`): the group plus `launch:` facts."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    return parse(raw, cluster_exclude=(raw.get("launch") or {}).get("cluster_exclude") or ())
