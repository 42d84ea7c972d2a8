"""Node health checks. Vendor tools are stood in for by scripts that print the recorded samples; a check
whose tool is absent is n/a (never pass), and fail only where the instance type says the hardware must exist."""

from pathlib import Path

import pytest

from csp_tools.cluster_validate import health
from csp_tools.cluster_validate.config import Expected

SAMPLES = Path(__file__).parent / "samples"
TRN1 = Expected(neuron_devices=16, neuron_cores=32, efa_devices=8, host_memory_gib=512)


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """tools(name=sample file or (text, exit code)): fake commands on an otherwise empty PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))

    def install(**commands):
        for name, spec in commands.items():
            text, code = (spec, 0) if isinstance(spec, str) else spec
            data = bin_dir / f"{name}.out"
            data.write_text((SAMPLES / text).read_text() if (SAMPLES / text).is_file() else text)
            script = bin_dir / name.replace("_", "-") if name != "fi_info" else bin_dir / name
            script.write_text(f"#!/bin/sh\n/bin/cat '{data}'\nexit {code}\n")  # PATH holds only the fakes
            script.chmod(0o755)
    return install


def by_name(checks):
    return {c.name: c for c in checks}


def test_absent_tools_are_not_applicable(tools):
    tools()
    assert [c.status for c in health.check_neuron(Expected(), "unknown", 5)] == ["n/a"]
    assert [c.status for c in health.check_gpus(Expected(), "unknown", 5)] == ["n/a"]
    assert health.check_efa(Expected(), "unknown", 5).status == "n/a"


def test_absent_tools_fail_where_the_instance_type_has_the_hardware(tools):
    tools()
    (neuron,) = health.check_neuron(TRN1, "trn1.32xlarge", 5)
    assert neuron.status == "fail" and "16 Neuron devices" in neuron.detail
    efa = health.check_efa(TRN1, "trn1.32xlarge", 5)
    assert efa.status == "fail" and "8 EFA devices" in efa.detail


def test_a_healthy_trn1_32xlarge(tools):
    tools(neuron_ls="neuron-ls.trn1.32xlarge.json", fi_info="fi_info.trn1.32xlarge.txt")
    checks = by_name(health.check_neuron(TRN1, "trn1.32xlarge", 5))
    assert checks["neuron devices"].status == "pass" and checks["neuron cores"].status == "pass"
    assert checks["neuron idle"].status == "warn", "a process still holds a device"
    assert health.check_efa(TRN1, "trn1.32xlarge", 5).status == "pass"


def test_a_trn1_32xlarge_missing_a_device_and_on_a_trn1n_efa_count(tools):
    tools(neuron_ls="neuron-ls.trn1.32xlarge.missing-device.json", fi_info="fi_info.trn1.32xlarge.txt")
    checks = by_name(health.check_neuron(TRN1, "trn1.32xlarge", 5))
    assert checks["neuron devices"].status == "fail" and "15 Neuron devices" in checks["neuron devices"].detail
    assert checks["neuron cores"].status == "fail"
    trn1n = Expected(neuron_devices=16, neuron_cores=32, efa_devices=16)
    efa = health.check_efa(trn1n, "trn1n.32xlarge", 5)
    assert efa.status == "fail" and efa.detail == "8 EFA devices, trn1n.32xlarge has 16"


def test_tool_errors_fail(tools):
    tools(neuron_ls=("neuron-ls: could not open /dev/neuron0", 1), fi_info=("fi_info.no-efa.txt", 61),
          nvidia_smi=("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", 9))
    (neuron,) = health.check_neuron(TRN1, "trn1.32xlarge", 5)
    assert neuron.status == "fail" and "exited 1" in neuron.detail
    assert health.check_efa(TRN1, "trn1.32xlarge", 5).status == "fail"
    assert health.check_efa(Expected(), "unknown", 5).status == "n/a", "no EFA where none is expected"
    (gpus,) = health.check_gpus(Expected(gpus=8), "p4d.24xlarge", 5)
    assert gpus.status == "fail" and "exited 9" in gpus.detail


def test_gpus(tools):
    tools(nvidia_smi="nvidia-smi.p4d.24xlarge.csv")
    (gpus,) = health.check_gpus(Expected(gpus=8), "p4d.24xlarge", 5)
    assert gpus.status == "pass" and "NVIDIA A100-SXM4-40GB" in gpus.detail


def test_instance_type_from_neuron_ls_when_dmi_has_none(tools, monkeypatch, tmp_path):
    monkeypatch.setattr(health, "DMI_PRODUCT", tmp_path / "no-dmi")
    tools(neuron_ls="neuron-ls.trn1.32xlarge.json")
    assert health.detect_instance_type("auto", 5) == "trn1.32xlarge"
    assert health.detect_instance_type("p5.48xlarge", 5) == "p5.48xlarge"
    (tmp_path / "dmi").write_text("trn1n.32xlarge\n")
    monkeypatch.setattr(health, "DMI_PRODUCT", tmp_path / "dmi")
    assert health.detect_instance_type("auto", 5) == "trn1n.32xlarge"


def test_paths_and_shared_marker(tmp_path):
    assert health.check_path(str(tmp_path), 0, "node1").status == "pass"
    assert health.check_path(str(tmp_path / "missing"), 0, "node1").status == "fail"
    assert health.check_path(str(tmp_path), 1e9, "node1").status == "fail", "below the free-space minimum"
    assert list((tmp_path / health.MARKER_DIR).iterdir()) == [], "the probe file is removed"
    marker = health.marker_path(str(tmp_path), "abc")
    assert health.check_shared(str(tmp_path), "abc").status == "fail"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text("abc\n")
    assert health.check_shared(str(tmp_path), "abc").status == "pass"


def test_memory():
    assert health.check_memory(0, Expected(), "unknown").status == "pass"
    assert health.check_memory(1e6, Expected(), "unknown").status == "fail"
    assert health.check_memory(0, Expected(host_memory_gib=1e6), "x").status == "fail"


def test_versions_compared_across_nodes():
    same = {"python": "3.11.7", "torch": "2.5.1", "torch-xla": None}
    checks = health.compare_versions({"a": same, "b": same, "c": {**same, "torch": "2.6.0"}})
    assert [checks[n].status for n in "abc"] == ["pass", "pass", "fail"]
    assert checks["c"].detail == "torch 2.6.0 (2 of 3 nodes have 2.5.1)"
    tie = health.compare_versions({"a": same, "b": {**same, "torch-xla": "2.5.0"}})
    assert tie["a"].status == tie["b"].status == "fail" and "no version has a majority" in tie["a"].detail
    assert health.compare_versions({"a": same})["a"].status == "n/a"


def test_clock_skew():
    checks = health.clock_checks({"a": (0.0, 0.001), "b": (2.5, 0.01), "c": (-1.2, 0.5), "d": None}, 1.0)
    assert [checks[n].status for n in "abcd"] == ["pass", "fail", "pass", "n/a"]
