"""Where the launcher finds its configs and templates: next to the package in a checkout, or NXDT_CONF_DIR."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def conf_dir() -> Path:
    return Path(os.environ.get("NXDT_CONF_DIR", REPO_ROOT / "conf")).resolve()


def templates_dir() -> Path:
    return Path(os.environ.get("NXDT_TEMPLATES_DIR", REPO_ROOT / "templates")).resolve()


def group_choices(group: str) -> list[str]:
    """Every option of a config group (`training` -> ['gpt3/tiny', 'llama/tiny', ...]), read from disk
    without importing Hydra so that `--help` stays instant."""
    root = conf_dir() / group
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


CONFIG_GROUPS = ("cluster", "data_preparation", "training", "fine_tuning", "peft", "alignment", "conversion",
                 "evaluation", "cluster_validation", "search_config")
