"""Helpers shared by the cluster validation tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.compose import compose, resolve


def write_stage_config(tmp_path: Path, *overrides: str) -> Path:
    """The file `nxdt-launch cluster-validate` would write for these overrides (keys of the group, unprefixed)."""
    from launcher.commands.cluster_validate import with_group_prefix

    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "results").mkdir(exist_ok=True)
    cfg = resolve(compose([f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data",
                           *(with_group_prefix(o) for o in overrides)]))
    path = tmp_path / "cluster_validation_config.yaml"
    path.write_text(yaml.safe_dump({**cfg["cluster_validation"], "launch": {"cluster_exclude": []}}))
    return path


@pytest.fixture
def stage_config(tmp_path):
    return lambda *overrides: write_stage_config(tmp_path, *overrides)
