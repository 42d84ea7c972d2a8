"""Config parsing, bandwidth arithmetic, the report's override, and the CLI's pure helpers."""

import pytest

from csp_tools.cluster_validate import config, report
from csp_tools.cluster_validate.bandwidth import (aligned_size, bus_factor, format_table, judged_size, make_row,
                                                  sweep_sizes)
from launcher.commands import cluster_validate as cli
from launcher.errors import UserError

from .conftest import write_stage_config


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == bus_factor("all_to_all", 8) == 7 / 8
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="valid"):
        bus_factor("reduce", 2)


def test_size_sweep_and_alignment():
    assert sweep_sizes(8, 128, 2) == [8, 16, 32, 64, 128]
    assert sweep_sizes(1024, 5000, 4) == [1024, 4096]
    assert aligned_size("all_gather", 1000, 3, 4) == 996 and aligned_size("all_reduce", 1001, 3, 4) == 1000
    assert aligned_size("all_to_all", 4, 8, 4) == 32, "never below one element per rank"
    assert judged_size([1024, 4096, 16384], 10000) == 4096 and judged_size([1024], 10) == 1024


def test_rows_and_the_nccl_tests_layout():
    row = make_row("all_reduce", 1 << 20, "float32", 1e-3, 4, 0)
    assert (row.count, row.type, row.time_us) == (262144, "float", 1000.0)
    assert row.algbw == pytest.approx(1.048576) and row.busbw == pytest.approx(1.048576 * 1.5)
    lines = format_table([row], "all_reduce · 4 ranks").splitlines()
    assert lines[1].split() == ["#", "size(B)", "count(elems)", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                                "#wrong"]
    assert lines[2].split() == ["1048576", "262144", "float", "1000.00", "1.049", "1.573", "0"]
    assert lines[3] == "# Avg bus bandwidth: 1.5729 GB/s"


def test_config_errors_name_every_key(tmp_path):
    raw = {"run": {"results_dir": "relative"}, "devices": 0, "accelerator": "tpu",
           "collectives": {"operations": ["all_reduce", "allreduce"], "min_bytes": "8M", "max_bytes": "1M",
                           "dtype": "int8"},
           "sweep": {"outlier_fraction": 2, "operation": "all_gather", "pair_operations": ["all_reduce"]}}
    with pytest.raises(config.ConfigError) as caught:
        config.parse(raw)
    problems = "\n".join(caught.value.problems)
    for key in ("cluster_validation.devices", "cluster_validation.accelerator", "operation 'allreduce'",
                "min_bytes", "dtype", "outlier_fraction", "pair_operations", "run.results_dir"):
        assert key in problems, key


def test_sizes_and_defaults(tmp_path):
    cfg = config.load(write_stage_config(tmp_path, "collectives.max_bytes=1G", "sweep.judge_bytes=256K"))
    assert cfg.collectives.max_bytes == 1 << 30 and cfg.sweep.judge_bytes == 256 << 10
    assert config.parse_size("64KiB") == 65536 and config.parse_size(8) == 8
    assert cfg.backend == "gloo" and cfg.expected_for("trn1.32xlarge").efa_devices == 8
    assert cfg.floors_for("trn1n.32xlarge").pair == 50 and cfg.floors_for("unknown").pair is None


def test_exclude_override_keeps_earlier_exclusions():
    assert report.exclude_override(["node7", "node3"]) == "cluster.exclude=[node3,node7]"
    assert report.exclude_override(["node3"], ("node9", "node3")) == "cluster.exclude=[node9,node3]"
    assert report.exclude_override([]) == "cluster.exclude=[]"


def test_group_prefix_hostlists_and_time_limits():
    assert cli.with_group_prefix("devices=32") == "cluster_validation.devices=32"
    assert cli.with_group_prefix("collectives.max_bytes=1G") == "cluster_validation.collectives.max_bytes=1G"
    assert cli.with_group_prefix("cluster.nodelist=[a]") == "cluster.nodelist=[a]"
    assert cli.with_group_prefix("cluster_validation.nodes=2") == "cluster_validation.nodes=2"
    assert cli.expand_hostlist("node[1-3,7],gpu[08-10],login") == [
        "node1", "node2", "node3", "node7", "gpu08", "gpu09", "gpu10", "login"]
    assert cli.expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert [cli.slurm_seconds(t) for t in ("30", "1:30", "0:20:00", "1-2", "2-0:30:00")] == [
        1800, 90, 1200, 93600, 174600]


def test_node_choice(tmp_path, monkeypatch):
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\nprintf 'n1\\nn2\\nn3\\nn2\\n'\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    cfg = {"cluster": {"partition": "trn1", "exclude": ["n2"], "nodelist": []}, "cluster_validation": {"nodes": None}}
    assert cli.choose_nodes(cfg, "slurm") == (2, ["n1", "n3"], [], [])
    assert (tmp_path / "args").read_text().split() == ["-h", "-N", "-t", "idle", "-o", "%N", "-p", "trn1"]
    (tmp_path / "args").unlink()
    count, nodelist, errors, (unchecked,) = cli.choose_nodes(cfg, "slurm", dry_run=True)
    assert (count, nodelist, errors) == (cli.DRY_RUN_NODES, [], []) and "idle" in unchecked
    assert not (tmp_path / "args").exists(), "a dry run does not ask Slurm"
    cfg["cluster"]["nodelist"] = ["n[4-6]"]
    assert cli.choose_nodes(cfg, "slurm") == (3, ["n[4-6]"], [], [])
    assert cli.choose_nodes(cfg, "slurm", dry_run=True) == (3, ["n[4-6]"], [], [])
    cfg["cluster_validation"]["nodes"] = 4
    assert cli.choose_nodes(cfg, "local")[2][0].startswith("cluster_validation.nodes: 4: a local run")
    sinfo.write_text("#!/bin/sh\n")
    cfg = {"cluster": {"partition": "trn1"}, "cluster_validation": {"nodes": None}}
    assert "no idle node in partition trn1" in cli.choose_nodes(cfg, "slurm")[2][0]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="sinfo failed"):
        cli.choose_nodes(cfg, "slurm")
