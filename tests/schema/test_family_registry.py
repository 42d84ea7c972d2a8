# What knows a model family lives in the families' folders (runtime/families) and their registry
# (runtime/schema/families/__init__.py; its shared readers base.py and decoder.py name none): every other source
# file asks the registry (`architecture(name).gated_mlp`, a family's module) and never branches on a family's name.
# This scans the code the way a reviewer would grep it, and is shown to catch a deliberate violation.
from __future__ import annotations

import ast
import itertools
import types
from pathlib import Path

from runtime.schema.families import ARCHITECTURES, FAMILIES, HF_MODEL_TYPES

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("runtime", "launcher", "csp_tools")
# The registry and the family folders: the only places a family is named.
HOMES = ("runtime/schema/families/__init__.py", "runtime/families/")
NAMES = frozenset(ARCHITECTURES) | frozenset(HF_MODEL_TYPES)


def _strings(node: ast.AST) -> list[str]:
    """The string constants a comparison operand spells (a name, or a tuple / list / set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _names_architecture(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "architecture") or \
        (isinstance(node, ast.Name) and node.id == "architecture")


def family_names(source: str, path: str = "<source>") -> list[str]:
    """Each place in `source` that names a family: a comparison of an architecture with a string, or a string that
    is exactly a registered architecture or Hugging Face model_type (docstrings aside), as `path:line: what`."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_architecture(o) for o in operands) and any(_strings(o) for o in operands):
                found.append(f"{path}:{node.lineno}: a branch on model.architecture's name")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in NAMES:
                found.append(f"{path}:{node.lineno}: the string {node.value!r}")
    return found


def test_only_the_registry_and_the_family_folders_name_a_family():
    found = []
    for top in SCANNED:
        for file in sorted((ROOT / top).rglob("*.py")):
            relative = file.relative_to(ROOT).as_posix()
            if not relative.startswith(HOMES):
                found += family_names(file.read_text(encoding="utf-8"), relative)
    assert found == [], "\n".join(found)


def test_the_scan_catches_a_deliberate_violation():
    violation = '''
def gated(cfg):
    """Whether the llama MLP is gated."""
    if cfg.architecture == "llama":
        return True
    return architecture in ("gpt", "other")
LAYERS = {"qwen3_moe": 1}
'''
    assert sorted(family_names(violation)) == ["<source>:4: a branch on model.architecture's name",
                                               "<source>:4: the string 'llama'",
                                               "<source>:6: a branch on model.architecture's name",
                                               "<source>:6: the string 'gpt'",
                                               "<source>:7: the string 'qwen3_moe'"]
    # Asking the registry is not naming: the same question, answered by the family's entry.
    assert family_names("def gated(cfg):\n    return architecture(cfg.architecture).gated_mlp\n") == []


def test_one_family_exports_each_model():
    """Exactly one Hugging Face family exports each architecture with each combination of the switches the families'
    exports() read, so the order FAMILIES tries them in (runtime/families EXPORT_ORDER) decides no export."""
    switches = itertools.product(ARCHITECTURES, (None, object()), (False, True), (False, True))
    for name, moe, qkv_bias, qk_norm in switches:
        cfg = types.SimpleNamespace(architecture=name, moe=moe, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm)
        assert len([family for family in FAMILIES if family.exports(cfg)]) == 1, cfg
