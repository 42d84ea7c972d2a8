# Parsers for the vendor tools a node check runs: neuron-ls -j, fi_info -p efa, nvidia-smi's CSV query and
# nccom-test's table. Pure text -> data, so they are tested on recorded samples (tests/cluster_validate/samples)
# on machines that have none of these tools. Each raises ValueError with what it expected when the text is not
# of the documented shape, so a changed tool shows up as a failed check rather than a silent zero.
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from csp_tools.cluster_validate.bandwidth import Row


@dataclass(frozen=True)
class NeuronDevices:
    devices: int
    cores: int                  # NeuronCores as neuron-ls counts them (logical cores when LNC > 1)
    instance_type: str | None   # newer neuron-ls versions report it per device
    processes: int              # processes holding a device (another job still running there)


def parse_neuron_ls(text: str) -> NeuronDevices:
    """`neuron-ls -j` (--json-output): a JSON array with one object per Neuron device, each with at least
    `neuron_device` and `nc_count`. Some wrappers nest the array under "neuron_devices"; both are accepted."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"neuron-ls -j did not print JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):
        data = data.get("neuron_devices")
    if not isinstance(data, list) or not all(isinstance(d, dict) and "nc_count" in d for d in data):
        raise ValueError("neuron-ls -j: expected a JSON array of devices, each with nc_count")
    types = {str(d["instance_type"]) for d in data if d.get("instance_type")}
    return NeuronDevices(
        devices=len(data),
        cores=sum(int(d["nc_count"]) for d in data),
        instance_type=types.pop() if len(types) == 1 else None,
        processes=sum(len(d.get("neuron_processes") or []) for d in data),
    )


def parse_fi_info(text: str, provider: str = "efa") -> list[str]:
    """`fi_info -p efa`: blocks of `provider: / fabric: / domain: / ...` lines. Every EFA device shows up as
    several domains (`rdmap16s27-rdm`, `rdmap16s27-dgrm`, and on libfabric 2 again under the efa-direct
    fabric); the device names are the domains without the endpoint-type suffix, counted once each."""
    devices: list[str] = []
    current = None
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if key == "provider":
            current = value
        elif key == "domain" and current == provider:
            name = re.sub(r"-(rdm|dgrm)$", "", value)
            if name not in devices:
                devices.append(name)
    return devices


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int


NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Output of NVIDIA_SMI_QUERY: one `index, name, memory.total` line per GPU, memory in MiB."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit():
            raise ValueError(f"nvidia-smi: expected 'index, name, memory.total' but got {line.strip()!r}")
        memory = int(fields[2]) if fields[2].isdigit() else 0  # "[N/A]" on some virtual GPUs
        gpus.append(Gpu(int(fields[0]), fields[1], memory))
    return gpus


def parse_nccom_test(text: str, operation: str, ranks: int) -> list[Row]:
    """nccom-test's table: a header line naming `size(B) count(elems) type time... algbw(GB/s) busbw(GB/s)`
    (older releases print `time:avg(us)`, newer ones add columns), one row per size, then `Avg bus bandwidth`.
    Columns are found by their header names, so added columns do not shift the ones read."""
    header = None
    rows: list[Row] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "size(B)" in fields:
            header = fields
            continue
        if header is None or not fields[0].isdigit() or len(fields) < len(header):
            continue
        col = dict(zip(header, fields))
        time_key = next(k for k in header if k.startswith("time"))
        wrong = None
        for key in ("check", "#wrong", "correctness"):
            if key in col:
                wrong = 0 if col[key].lower() in ("0", "pass", "passed", "ok") else 1
        rows.append(Row(operation, int(col["size(B)"]), int(col["count(elems)"]), col["type"], float(col[time_key]),
                        float(col["algbw(GB/s)"]), float(col["busbw(GB/s)"]), wrong, ranks, source="nccom-test"))
    if header is None:
        raise ValueError("nccom-test: no 'size(B) count(elems) type time(us) algbw(GB/s) busbw(GB/s)' header")
    return rows
