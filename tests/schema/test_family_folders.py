"""A model family (runtime/families/<name>/, issue 58) is known in one place: outside its folder only the registry
names it, besides tests, docs and recipes (conf). Checked for each registered family over every source file of the
repository, and on deliberate violations, in one of two ways by what else spells the family's name:

- Plain text, for a name nothing else spells (gemma3, gpt_oss, deepseek_v3): outside the family's folder, the
  registry (runtime/families/__init__.py), tests/, docs/, conf/ and README.md, no file's text or path holds the name
  without its generation number (gemma3 -> gemma), in any case.
- Code, for a name that recipe names (gpt3/tiny, llama3/8b), another family (gpt_oss), help texts and comments
  spell too (gpt, llama): its NAMES are its architecture, the model_type of each Hugging Face family it is (its own
  and its VARIANTS', a refused one included) and its modules' names (the folder, each VARIANTS module). In every
  Python file outside its folder, tests/, benchmarks/ and the registry modules (runtime/families/__init__.py,
  runtime/schema/families/__init__.py):
    * no string constant equal to one of the NAMES, nor a module path ("a.b.c", "a.b:attribute") or a .py file path
      ("a/b/c.py") with one as a part;
    * no identifier equal to one, in any case: a name, an attribute, a definition, an argument, an import's alias;
      and no import of a module path with one as a part;
    * no Python file or package named after one (a part of the file's path, its extension dropped).
  Comments, docstrings' prose and longer strings ("llama3/8b", "see the llama recipes") describe, and are not code.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from runtime.schema.folder_families import export_order, folder_family, folders, hf_families

REPO = Path(__file__).resolve().parents[2]
# Where a family may be named outside its folder: the registry's lines, and what describes or exercises it.
ALLOWED = ("runtime/families/__init__.py", "tests/", "docs/", "conf/", "README.md")
# The families whose names other words spell: checked in their code (CODE_ALLOWED) rather than in their text.
CODE_ONLY = ("gpt", "llama")
# What may name them in code: the registry modules, and what exercises a family (tests, benchmarks: a config's
# architecture).
CODE_ALLOWED = ("runtime/families/__init__.py", "runtime/schema/families/__init__.py", "tests/", "benchmarks/")
_SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules"}
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:\w+)?")


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


def family_names(family: str) -> frozenset[str]:
    """The family's NAMES (see the docstring above), from its folder."""
    module = folder_family(family)
    names = {family, module.ARCHITECTURE.name}
    for hf in hf_families(module):
        names |= {hf.__name__.rpartition(".")[2], *hf.MODEL_TYPES, *getattr(hf, "REFUSED_MODEL_TYPES", ())}
    return frozenset(names)


def _string_parts(text: str) -> list[str]:
    """The parts of a string that is a module path or a .py file path (the string itself otherwise)."""
    if _MODULE_PATH.fullmatch(text):
        return re.split(r"[.:]", text)
    if text.endswith(".py"):
        return text[:-3].split("/")
    return [text]


def _identifiers(node: ast.AST) -> list[str]:
    """The identifiers a node spells, and the parts of the module paths it imports."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.alias):
        return [*node.name.split("."), *([node.asname] if node.asname else [])]
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")
    return []


def code_naming(source: str, names: frozenset[str], path: str = "<source>") -> list[str]:
    """Each place in `source`'s code that names one of `names`, as `path:line: what`, in line order."""
    folded = {name.casefold() for name in names}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if hit := sorted(names & set(_string_parts(node.value))):
                found.append((node.lineno, f"the string {node.value!r} ({', '.join(hit)})"))
        elif hit := sorted({i for i in _identifiers(node) if i.casefold() in folded}):
            found.append((node.lineno, f"the identifier {', '.join(hit)}"))
    return [f"{path}:{line}: {what}" for line, what in sorted(found)]


def code_naming_outside(root: Path, family: str, names: frozenset[str]) -> list[str]:
    """Each place in the Python files under `root`, outside runtime/families/<family>/ and CODE_ALLOWED, that names
    the family (`names`: its NAMES), and each such file whose path is named after it."""
    own, folded = f"runtime/families/{family}/", {name.casefold() for name in names}
    found = []
    for rel, path in _sources(root):
        if path.suffix != ".py" or rel.startswith(own) or rel.startswith(CODE_ALLOWED):
            continue
        if hit := sorted({part for part in rel[:-3].split("/") if part.casefold() in folded}):
            found.append(f"{rel}: a module named {', '.join(hit)}")
        found += code_naming(path.read_text(encoding="utf-8"), names, rel)
    return found


@pytest.mark.parametrize("family", [name for name in folders() if name not in CODE_ONLY])
def test_only_the_registry_names_a_folder_family(family):
    assert naming_outside(REPO, family) == []


@pytest.mark.parametrize("family", folders())
def test_only_the_registry_names_a_family_in_code(family):
    found = code_naming_outside(REPO, family, family_names(family))
    assert found == [], "\n".join(found)


def test_every_family_is_checked_and_exported():
    assert set(CODE_ONLY) <= set(folders())
    assert sorted(export_order()) == sorted(folders())
    assert family_names("llama") == {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"}
    assert family_names("gpt") == {"gpt", "gpt2"}


def test_a_deliberate_violation_is_found(tmp_path):
    for rel, text in [("runtime/families/__init__.py", 'FOLDERS = ("gemma3",)'),
                      ("runtime/families/gemma3/model.py", "class Gemma3Model: ..."),
                      ("tests/test_x.py", "gemma3"), ("runtime/convert/hf.py", 'if arch == "gemma3": ...'),
                      ("launcher/estimator/shapes.py", "# the Llama decoder's MLP")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert naming_outside(tmp_path, "gemma3") == ["runtime/convert/hf.py"]


def test_a_deliberate_violation_in_code_is_found(tmp_path):
    for rel, text in [
        # Allowed: the registry's lines, the family's folder, tests, and what only describes.
        ("runtime/families/__init__.py", 'FOLDERS = ("gpt", "llama")'),
        ("runtime/schema/families/__init__.py", 'HF_BASE = ARCHITECTURES["llama"]'),
        ("runtime/families/llama/mixtral.py", 'def exports(cfg):\n    return cfg.architecture == "llama"'),
        ("tests/test_x.py", 'from runtime.families import llama\nARCH = "llama"'),
        ("runtime/families/gpt_oss/config.py", 'NAME = "gpt_oss"  # not gpt'),
        ("launcher/help.py", '# the Llama decoder\nRECIPE = "llama3/8b"\nTINY = "llama/tiny"\n'
                             'def f():\n    """Reads a llama checkpoint."""\n'),
        ("conf/training/llama/tiny.yaml", "architecture: llama"),
        # Violations: a string, a module named after the family, an import, a dynamic import, an identifier.
        ("runtime/convert/hf.py", 'def f(model_type):\n    return model_type == "mistral"'),
        ("runtime/models/llama.py", "class LlamaModel: ..."),
        ("launcher/imports.py", "from runtime.families.llama import model"),
        ("launcher/dynamic.py", 'import importlib\nmodule = importlib.import_module("runtime.families.llama.model")'),
        ("runtime/schema/rules_x.py", "def f(family):\n    return family.Qwen3_moe"),
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    names = family_names("llama")
    assert code_naming_outside(tmp_path, "llama", names) == [
        "launcher/dynamic.py:2: the string 'runtime.families.llama.model' (llama)",
        "launcher/imports.py:1: the identifier llama",
        "runtime/convert/hf.py:2: the string 'mistral' (mistral)",
        "runtime/models/llama.py: a module named llama",
        "runtime/schema/rules_x.py:2: the identifier Qwen3_moe"]
    assert code_naming_outside(tmp_path, "gpt", family_names("gpt")) == []


def test_a_folder_familys_keys_are_refused_on_other_architectures():
    from runtime.schema.families import architecture as network
    from runtime.schema.rules import MODEL_SWITCHES, llama_switches

    # The keys only the newer folders compute (GPT-2's block and the Llama decoder compute none of them).
    family_switches = [key for key in MODEL_SWITCHES if key not in network("gpt").switches + network("llama").switches]
    assert family_switches == ["sliding_window", "layer_types", "local_rotary_base", "softmax_scale",
                               "latent_attention"]
    for key in family_switches:
        computing = [name for name in folders() if key in network(name).switches]
        for architecture in ("gpt", "llama"):
            assert llama_switches(architecture, {key: 8}, "training.") == [
                f"training.model.{key}: architecture={architecture} does not compute it; drop training.model.{key} "
                f"(architectures that do: {', '.join(computing)})"]
        for name in computing:
            assert llama_switches(name, {key: 8}, "training.") == []
