"""Parsers of vendor tool output, on recorded samples (samples/README.md says how they were made): neuron-ls,
fi_info, nvidia-smi and nccom-test cannot run on the machines these tests run on."""

from pathlib import Path

import pytest

from csp_tools.cluster_validate import parsers
from csp_tools.cluster_validate.bandwidth import bus_factor

SAMPLES = Path(__file__).parent / "samples"


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def test_neuron_ls_trn1_32xlarge():
    found = parsers.parse_neuron_ls(sample("neuron-ls.trn1.32xlarge.json"))
    assert (found.devices, found.cores, found.instance_type, found.processes) == (16, 32, "trn1.32xlarge", 1)


def test_neuron_ls_older_format_and_a_missing_device():
    found = parsers.parse_neuron_ls(sample("neuron-ls.trn1.32xlarge.missing-device.json"))
    assert (found.devices, found.cores, found.instance_type) == (15, 30, None)
    small = parsers.parse_neuron_ls(sample("neuron-ls.trn1.2xlarge.json"))
    assert (small.devices, small.cores) == (1, 2)


def test_neuron_ls_nested_and_malformed():
    assert parsers.parse_neuron_ls('{"neuron_devices": [{"neuron_device": 0, "nc_count": 4}]}').cores == 4
    with pytest.raises(ValueError, match="did not print JSON"):
        parsers.parse_neuron_ls("neuron-ls: command failed")
    with pytest.raises(ValueError, match="nc_count"):
        parsers.parse_neuron_ls('[{"neuron_device": 0}]')


def test_fi_info_counts_devices_not_domains():
    assert len(parsers.parse_fi_info(sample("fi_info.trn1.32xlarge.txt"))) == 8
    assert parsers.parse_fi_info(sample("fi_info.libfabric2.txt")) == ["rdmap47s0", "rdmap48s0"]
    assert parsers.parse_fi_info(sample("fi_info.no-efa.txt")) == []
    other = "provider: tcp\n    fabric: 10.0.0.0/24\n    domain: eth0\n"
    assert parsers.parse_fi_info(other) == [], "only the efa provider's domains count"


def test_nvidia_smi_csv():
    gpus = parsers.parse_nvidia_smi(sample("nvidia-smi.p4d.24xlarge.csv"))
    assert len(gpus) == 8 and gpus[7] == parsers.Gpu(7, "NVIDIA A100-SXM4-40GB", 40960)
    assert parsers.parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, [N/A]\n")[0].memory_mib == 0
    with pytest.raises(ValueError, match="index, name, memory.total"):
        parsers.parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")


def test_nccom_test_table():
    rows = parsers.parse_nccom_test(sample("nccom-test.allr.txt"), "all_reduce", 32)
    assert [r.size for r in rows] == [1024 * 4**i for i in range(7)]
    last = rows[-1]
    assert (last.count, last.type, last.time_us, last.algbw, last.busbw) == (1048576, "fp32", 368.0, 11.40, 22.08)
    assert all(r.source == "nccom-test" and r.wrong is None and r.ranks == 32 for r in rows)
    # the tool's busbw follows the same factor as ours (2(n-1)/n for all-reduce), within its rounding
    assert abs(last.busbw - last.algbw * bus_factor("all_reduce", 32)) < 0.01


def test_nccom_test_columns_are_read_by_name():
    rows = parsers.parse_nccom_test(sample("nccom-test.extra-columns.txt"), "all_gather", 32)
    assert [(r.size, r.time_us, r.busbw, r.wrong) for r in rows] == [
        (1048576, 129.0, 7.88, 0), (2097152, 201.0, 10.11, 0), (4194304, 345.0, 11.78, 1)]
    with pytest.raises(ValueError, match="header"):
        parsers.parse_nccom_test("ERROR: failed to load NEFF", "all_gather", 32)
