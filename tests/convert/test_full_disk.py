"""A full disk in the conversion stage's export and import (issue 57): one `error:` line naming the directory key and
the fix, exit 1, no traceback, and nothing half-written: no temporary directory beside the export, no uncommitted
step_* directory in the import's checkpoint_dir. The disk fills by the file-size limit (tests/full_disk.py
simulates ENOSPC with RLIMIT_FSIZE: EFBIG)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from runtime.io.files import is_temp
from tests.convert.test_rerun import checkpoints  # noqa: F401  (a fixture: two imported checkpoints of a tiny GPT)
from tests.full_disk import file_size_limit
from tests.launcher.helpers import REPO


@pytest.mark.parametrize("mode", ["export", "import"])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, checkpoints, mode):  # noqa: F811
    out = tmp_path / ("hf_model" if mode == "export" else "imported")
    raw = ({"mode": "export", "checkpoint_dir": checkpoints[0], "output_dir": str(out)} if mode == "export" else
           {"mode": "import", "checkpoint_dir": str(out), "hf_checkpoint_dir": str(tmp_path / "hf")})
    config = tmp_path / "conversion_config.yaml"
    config.write_text(yaml.safe_dump(raw))
    before = sorted(tmp_path.rglob("*"))
    result = subprocess.run([sys.executable, "-m", "runtime.convert", "--config", str(config)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
                            preexec_fn=file_size_limit(20_000))  # the weights are ~160 KB
    assert result.returncode == 1, result.stderr
    key = "conversion.output_dir" if mode == "export" else "conversion.checkpoint_dir"
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {key} '{out}': no room to write (File too large); nothing half-written "
                               f"was kept") and f"set {key} to a disk with room" in lines[0], lines
    left = sorted(set(tmp_path.rglob("*")) - set(before))
    assert [p for p in left if p != out or any(out.iterdir())] == [], left  # at most the empty directory asked for
    assert not [p for p in tmp_path.rglob("*") if is_temp(p.name)]
