"""The demo corpus (tokenizer + token files) made by the launcher's own data stage, for tests that train."""

from pathlib import Path

from tests.launcher.helpers import nxdt


def prepare_demo_data(root: Path) -> Path:
    """Run `nxdt-launch stages=[data_preparation]` locally under `root`; returns the data_dir holding demo/."""
    result = nxdt("stages=[data_preparation]", "cluster_type=local", f"data_dir={root / 'data'}",
                  f"base_results_dir={root / 'results'}", cwd=root, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (root / "data" / "demo" / "blend.txt").exists()
    return root / "data"
