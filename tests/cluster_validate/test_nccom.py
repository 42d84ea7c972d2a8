"""A Neuron node as the agent sees it, with neuron-ls and nccom-test stood in for by scripts that print the
recorded samples (the real tools need Trainium hardware): nccom-test runs with the sweep's flags, once per
operation, and its table lands in the report as rows of the same layout. The agent runs forked from the test process
(conftest.agent_here)."""

import json
import os
from pathlib import Path

from tests.cluster_validate.conftest import agent_here

SAMPLES = Path(__file__).parent / "samples"


def test_nccom_test_results_join_the_report(stage_config, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "neuron-ls").write_text(f"#!/bin/sh\ncat {SAMPLES}/neuron-ls.trn1.32xlarge.json\n")
    (bin_dir / "nccom-test").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/nccom-args\n"
                                        f"cat {SAMPLES}/nccom-test.allr.txt\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    config = stage_config("accelerator=neuron", "devices=32", "instance_type=trn1.32xlarge",
                          "collectives.operations=[all_reduce,all_gather]", "collectives.max_bytes=4M",
                          "sweep.intra_node=false",
                          "expected.trn1_32xlarge.efa_devices=0", "expected.trn1_32xlarge.host_memory_gib=null")
    done = agent_here(config, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=120)
    report = json.loads((tmp_path / "results/cluster_validation/cluster_validation/cluster_validation.json")
                        .read_text())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report["passed"], report["verdicts"]

    checks = {c["name"]: c["status"] for c in next(iter(report["health"].values()))}
    assert checks["neuron devices"] == "pass" and checks["neuron cores"] == "pass"
    assert (tmp_path / "nccom-args").read_text().splitlines() == [
        "-r 32 -b 1024 -e 4194304 -f 4 -n 20 -w 5 allr", "-r 32 -b 1024 -e 4194304 -f 4 -n 20 -w 5 allg"]
    (test,) = [t for t in report["tests"] if t["phase"] == "nccom-test"]
    assert test["source"] == "nccom-test" and test["ranks"] == 32
    assert [r["operation"] for r in test["rows"]] == ["all_reduce"] * 7 + ["all_gather"] * 7
    assert test["judged"] == {"operation": "all_reduce", "size": 4194304, "busbw": 22.08, "error": None}
    assert "# all_reduce · nccom-test" in done.stdout and "Avg bus bandwidth" in done.stdout
