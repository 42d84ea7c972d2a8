"""Where the launcher finds its configs and templates (next to the package in a checkout, or NXDT_CONF_DIR), and
where a dry run of a live run renders."""

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from runtime.schema.stages import STAGES

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


# Every stage is configured by the group of its name (runtime/schema/stages.py).
CONFIG_GROUPS = ("cluster", *STAGES, "cluster_validation", "search_config")


DRY_RUN_KEEP_S = 60  # an earlier dry run's directory younger than this may belong to a dry run still writing it


def dry_run_dir(run_name: str) -> Path:
    """A new directory for a dry run of a live run to render into (launch.make_plan; the live run's own files must
    not change). One is kept per run: the directories earlier dry runs of this run left (this user's, over a minute
    old) are removed first, so that dry runs do not pile up in the temporary directory."""
    prefix = f"nxdt-dry-run-{run_name}-"
    ours = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}")  # mkdtemp's names: not another run's whose name runs on
    root = Path(tempfile.gettempdir())
    for entry in root.glob("nxdt-dry-run-*"):
        try:
            stat = entry.lstat()
        except OSError:
            continue
        if ours.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink() and stat.st_uid == os.getuid() \
                and time.time() - stat.st_mtime > DRY_RUN_KEEP_S:
            shutil.rmtree(entry, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))
