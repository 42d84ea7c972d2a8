"""A folder family (runtime/families/<name>/, issue 58) is known in one place: outside its folder only the registry
(runtime/families/__init__.py) names it, besides tests, docs and recipes (conf). Checked over every source file of
the repository for each registered family, and on a deliberate violation."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from runtime.schema.folder_families import folders

REPO = Path(__file__).resolve().parents[2]
# Where a family may be named outside its folder: the registry's one line, and what describes or exercises it.
ALLOWED = ("runtime/families/__init__.py", "tests/", "docs/", "conf/", "README.md")
_SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules"}


def _mention(family: str) -> re.Pattern:
    """The family's name without its generation number (gemma3 -> gemma), case-insensitive."""
    return re.compile(re.escape(family.rstrip("0123456789")), re.IGNORECASE)


def _sources(root: Path):
    """Every file of the tree that is not built or generated: in a git checkout what git tracks or would track (so
    results/, .hypothesis/ and an egg-info a test run or pip leaves there are not sources), elsewhere every file."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                                check=True, capture_output=True).stdout.decode().split("\0")
        paths = [root / rel for rel in sorted(set(listed)) if rel]
    else:
        paths = sorted(root.rglob("*"))
    for path in paths:
        rel = path.relative_to(root)
        if path.is_file() and not _SKIPPED_DIRS & set(rel.parts) and path.suffix not in (".pyc", ".so"):
            yield rel.as_posix(), path


def naming_outside(root: Path, family: str) -> list[str]:
    """Files under `root` outside runtime/families/<family>/ and ALLOWED whose text names the family."""
    pattern, own = _mention(family), f"runtime/families/{family}/"
    found = []
    for rel, path in _sources(root):
        if rel.startswith(own) or rel.startswith(ALLOWED):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if pattern.search(text) or pattern.search(rel):
            found.append(rel)
    return found


@pytest.mark.parametrize("family", folders())
def test_only_the_registry_names_a_folder_family(family):
    assert naming_outside(REPO, family) == []


def test_a_deliberate_violation_is_found(tmp_path):
    for rel, text in [("runtime/families/__init__.py", 'FOLDERS = ("gemma3",)'),
                      ("runtime/families/gemma3/model.py", "class Gemma3Model: ..."),
                      ("tests/test_x.py", "gemma3"), ("runtime/convert/hf.py", 'if arch == "gemma3": ...'),
                      ("launcher/estimator/shapes.py", "# the Llama decoder's MLP")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert naming_outside(tmp_path, "gemma3") == ["runtime/convert/hf.py"]


def test_a_folder_familys_keys_are_refused_on_other_architectures():
    from runtime.schema.families import architecture as network
    from runtime.schema.rules import FAMILY_SWITCHES, llama_switches

    for key in FAMILY_SWITCHES:
        computing = [name for name in folders() if key in network(name).switches]
        for architecture in ("gpt", "llama"):
            assert llama_switches(architecture, {key: 8}, "training.") == [
                f"training.model.{key}: architecture={architecture} does not compute it; drop training.model.{key} "
                f"(architectures that do: {', '.join(computing)})"]
        for name in computing:
            assert llama_switches(name, {key: 8}, "training.") == []
