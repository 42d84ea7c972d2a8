# Node health: checks one node runs on itself (`local_checks`), and the comparisons only the coordinator can
# make because they need every node's facts (`compare_versions`, `clock_checks`). Each check is one line with a
# status: pass, warn, fail, or n/a. A check whose tool is absent is n/a, never pass; it is fail only when the
# node's instance type says the hardware must be there (a trn1.32xlarge without neuron-ls is broken).
from __future__ import annotations

import collections
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from csp_tools.cluster_validate import parsers
from csp_tools.cluster_validate.config import Expected, ValidationConfig

PASS, WARN, FAIL, NA = "pass", "warn", "fail", "n/a"
MARKER_DIR = ".nxdt_cluster_validate"
DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")  # the instance type on EC2 Nitro instances
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def run_tool(argv: list[str], timeout: float) -> tuple[int, str] | None:
    """(exit code, stdout + stderr) of a vendor tool, or None when it is not on PATH."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]} did not finish within {timeout:g}s"
    return done.returncode, done.stdout + (("\n" + done.stderr) if done.returncode else "")


def detect_instance_type(configured: str, timeout: float) -> str:
    if configured != "auto":
        return configured
    try:
        product = DMI_PRODUCT.read_text().strip()
        if _INSTANCE_TYPE.match(product):
            return product
    except OSError:
        pass
    found = run_tool(["neuron-ls", "-j"], timeout)
    if found and found[0] == 0:
        try:
            return parsers.parse_neuron_ls(found[1]).instance_type or "unknown"
        except ValueError:
            pass
    return "unknown"


def _count_check(name: str, what: str, found: int, expected: int | None, instance_type: str) -> Check:
    if expected is None:
        return Check(name, PASS, f"{found} {what} (no expectation for instance type {instance_type})",
                     {"found": found})
    if found < expected:
        return Check(name, FAIL, f"{found} {what}, {instance_type} has {expected}", {"found": found,
                                                                                   "expected": expected})
    status = PASS if found == expected else WARN
    return Check(name, status, f"{found} {what} (expected {expected} on {instance_type})",
                 {"found": found, "expected": expected})


def check_neuron(expected: Expected, instance_type: str, timeout: float) -> list[Check]:
    found = run_tool(["neuron-ls", "-j"], timeout)
    if found is None:
        if expected.neuron_devices:
            return [Check("neuron devices", FAIL, f"neuron-ls is not on PATH but {instance_type} has "
                                                  f"{expected.neuron_devices} Neuron devices")]
        return [Check("neuron devices", NA, "neuron-ls is not on PATH")]
    code, text = found
    if code != 0:
        return [Check("neuron devices", FAIL, f"neuron-ls -j exited {code}: {' '.join(text.split())[:200]}")]
    try:
        devices = parsers.parse_neuron_ls(text)
    except ValueError as error:
        return [Check("neuron devices", FAIL, str(error))]
    checks = [_count_check("neuron devices", "Neuron devices", devices.devices, expected.neuron_devices,
                           instance_type),
              _count_check("neuron cores", "NeuronCores", devices.cores, expected.neuron_cores, instance_type)]
    if devices.processes:
        checks.append(Check("neuron idle", WARN, f"{devices.processes} process(es) hold Neuron devices"))
    return checks


def check_gpus(expected: Expected, instance_type: str, timeout: float) -> list[Check]:
    found = run_tool(parsers.NVIDIA_SMI_QUERY, timeout)
    if found is None:
        if expected.gpus:
            return [Check("gpus", FAIL, f"nvidia-smi is not on PATH but {instance_type} has {expected.gpus} GPUs")]
        return [Check("gpus", NA, "nvidia-smi is not on PATH")]
    code, text = found
    if code != 0:
        return [Check("gpus", FAIL, f"nvidia-smi exited {code}: {' '.join(text.split())[:200]}")]
    try:
        gpus = parsers.parse_nvidia_smi(text)
    except ValueError as error:
        return [Check("gpus", FAIL, str(error))]
    return [_count_check("gpus", f"GPUs ({', '.join(sorted({g.name for g in gpus})) or 'none'})", len(gpus),
                         expected.gpus, instance_type)]


def check_efa(expected: Expected, instance_type: str, timeout: float) -> Check:
    found = run_tool(["fi_info", "-p", "efa"], timeout)
    if found is None:
        if expected.efa_devices:
            return Check("efa", FAIL, f"fi_info is not on PATH but {instance_type} has {expected.efa_devices} "
                                      "EFA devices (install the EFA software)")
        return Check("efa", NA, "fi_info is not on PATH")
    code, text = found
    devices = parsers.parse_fi_info(text) if code == 0 else []
    if not devices:
        if expected.efa_devices:
            return Check("efa", FAIL, f"fi_info -p efa lists no EFA provider; {instance_type} has "
                                      f"{expected.efa_devices} EFA devices")
        return Check("efa", NA, "no EFA provider (fi_info -p efa found none)")
    return _count_check("efa", "EFA devices", len(devices), expected.efa_devices, instance_type)


def check_path(path: str, min_free_gib: float, node: str) -> Check:
    """Free space, then a 1 MiB write, fsync, read back and compare: what a checkpoint write needs."""
    name = f"path {path}"
    if "://" in path:
        return Check(name, NA, "not a file system path (object storage is staged by the job itself)")
    target = Path(path)
    if not target.is_dir():
        return Check(name, FAIL, "does not exist (or is not a directory) on this node")
    free_gib = shutil.disk_usage(target).free / 2**30
    probe = target / MARKER_DIR / f"rw.{node}.{os.getpid()}"
    payload = os.urandom(1 << 20)
    try:
        probe.parent.mkdir(exist_ok=True)
        with open(probe, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        same = probe.read_bytes() == payload
    except OSError as error:
        return Check(name, FAIL, f"write/read failed: {error.strerror or error}", {"free_gib": round(free_gib, 2)})
    finally:
        probe.unlink(missing_ok=True)
    if not same:
        return Check(name, FAIL, "the data read back differs from the data written")
    status = PASS if free_gib >= min_free_gib else FAIL
    return Check(name, status, f"{free_gib:.1f} GiB free (minimum {min_free_gib:g}); 1 MiB write/read ok",
                 {"free_gib": round(free_gib, 2)})


def marker_path(shared_path: str, token: str) -> Path:
    return Path(shared_path) / MARKER_DIR / f"shared.{token}"


def check_shared(shared_path: str, token: str) -> Check:
    """Node 0 wrote a marker with a fresh token; seeing it here means this is the same file system."""
    name = f"shared {shared_path}"
    try:
        seen = marker_path(shared_path, token).read_text().strip()
    except OSError:
        return Check(name, FAIL, "node 0's marker file is not visible here: not the same shared file system "
                                 "at this path (unmounted, or a different mount)")
    if seen != token:
        return Check(name, FAIL, "the marker file differs from node 0's")
    return Check(name, PASS, "same file system as node 0")


def check_memory(min_available_gib: float, expected: Expected, instance_type: str) -> Check:
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return Check("memory", NA, "/proc/meminfo is not readable")
    total, available = info.get("MemTotal", 0) / 2**30, info.get("MemAvailable", 0) / 2**30
    data = {"total_gib": round(total, 1), "available_gib": round(available, 1)}
    if available < min_available_gib:
        return Check("memory", FAIL, f"{available:.1f} GiB available of {total:.1f} GiB (minimum "
                                     f"{min_available_gib:g}): something else holds the memory", data)
    if expected.host_memory_gib and total < 0.9 * expected.host_memory_gib:
        return Check("memory", FAIL, f"{total:.0f} GiB installed, {instance_type} has {expected.host_memory_gib:g}",
                     data)
    return Check("memory", PASS, f"{available:.1f} GiB available of {total:.1f} GiB", data)


def _system_package_version(name: str, timeout: float) -> str | None:
    for argv in (["dpkg-query", "-W", "-f=${Version}", name], ["rpm", "-q", "--qf", "%{VERSION}-%{RELEASE}", name]):
        found = run_tool(argv, timeout)
        if found and found[0] == 0 and found[1].strip():
            return found[1].strip()
    return None


def versions(cfg: ValidationConfig, timeout: float) -> dict[str, str | None]:
    """Python, the configured Python distributions and system packages: None where not installed."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in cfg.health.python_packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    for name in cfg.health.system_packages:
        found[name] = _system_package_version(name, timeout)
    return found


def local_checks(cfg: ValidationConfig, node: str, instance_type: str, token: str) -> list[Check]:
    """Every check this node can make on its own."""
    timeout = cfg.health.timeout_s
    expected = cfg.expected_for(instance_type)
    checks: list[Check] = []
    if cfg.accelerator == "neuron" or expected.neuron_devices:
        checks += check_neuron(expected, instance_type, timeout)
    if cfg.accelerator == "gpu" or expected.gpus:
        checks += check_gpus(expected, instance_type, timeout)
    if not checks:
        checks.append(Check("accelerator", NA, f"{cfg.accelerator} node: no accelerator expected"))
    checks.append(check_efa(expected, instance_type, timeout))
    checks += [check_path(path, cfg.health.min_free_gib, node) for path in cfg.health.paths]
    checks += [check_shared(path, token) for path in cfg.health.shared_paths]
    checks.append(check_memory(cfg.health.min_available_memory_gib, expected, instance_type))
    return checks


def node_facts(cfg: ValidationConfig, instance_type: str) -> dict:
    return {"hostname": socket.gethostname(), "kernel": platform.release(), "instance_type": instance_type,
            "versions": versions(cfg, cfg.health.timeout_s),
            "tools": {tool: shutil.which(tool) is not None for tool in ("neuron-ls", "nccom-test", "fi_info",
                                                                         "nvidia-smi")}}


def compare_versions(by_node: dict[str, dict[str, str | None]]) -> dict[str, Check]:
    """One `versions` check per node: fail where a version differs from the one most nodes have (every node
    fails a package on which no version has a majority). Packages no node has are left out."""
    if len(by_node) < 2:
        return {node: Check("versions", NA, "one node: nothing to compare", {"versions": v})
                for node, v in by_node.items()}
    differences: dict[str, list[str]] = {node: [] for node in by_node}
    names = sorted({name for v in by_node.values() for name in v})
    for name in names:
        values = {node: v.get(name) for node, v in by_node.items()}
        if all(value is None for value in values.values()):
            continue
        counts = collections.Counter(values.values()).most_common()
        has_majority = len(counts) == 1 or counts[0][1] > counts[1][1]
        for node, value in values.items():
            if has_majority and value == counts[0][0]:
                continue
            usual = (f"{counts[0][1]} of {len(values)} nodes have {counts[0][0] or 'none'}" if has_majority
                     else "no version has a majority")
            differences[node].append(f"{name} {value or 'missing'} ({usual})")
    checks = {}
    for node, diffs in differences.items():
        if diffs:
            checks[node] = Check("versions", FAIL, "; ".join(diffs), {"versions": by_node[node]})
        else:
            checks[node] = Check("versions", PASS, f"same as the other nodes ({len(names)} packages)",
                                 {"versions": by_node[node]})
    return checks


def clock_checks(offsets: dict[str, tuple[float, float] | None], max_skew_s: float) -> dict[str, Check]:
    """Offset of each node's clock from node 0's, with the measurement's uncertainty (half the round trip)."""
    checks = {}
    for node, measured in offsets.items():
        if measured is None:
            checks[node] = Check("clock", NA, "not measured")
            continue
        offset, uncertainty = measured
        data = {"offset_s": offset, "uncertainty_s": uncertainty}
        if abs(offset) - uncertainty > max_skew_s:
            checks[node] = Check("clock", FAIL, f"{offset:+.3f}s from node 0 (±{uncertainty:.3f}s), more than "
                                                f"{max_skew_s:g}s: check chrony/NTP", data)
        else:
            checks[node] = Check("clock", PASS, f"{offset:+.3f}s from node 0 (±{uncertainty:.3f}s)", data)
    return checks
