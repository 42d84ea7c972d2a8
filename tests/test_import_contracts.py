"""The seams docs/architecture.md promises, checked on the source (ast, no imports), so they cannot drift:
models never import torch.distributed; only the collectives and topology modules do (pipeline p2p goes through
collectives); only runtime/device.py compares device kinds. Each checker is also shown a violation."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime"
DISTRIBUTED_OWNERS = {"runtime/parallel/collectives.py", "runtime/parallel/topology.py"}
DEVICE_KINDS = {"cpu", "cuda", "xla", "neuron", "gpu"}


def distributed_imports(source: str) -> list[int]:
    """Lines that import torch.distributed (in any spelling)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("torch.distributed") or
                (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            lines.append(node.lineno)
    return lines


def device_kind_branches(source: str) -> list[int]:
    """Comparisons of a device's kind or type against a device name ("cuda", "xla", ...)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {c.value for side in sides for c in ast.walk(side) if isinstance(c, ast.Constant)}
        attrs = {a.attr for side in sides for a in ast.walk(side) if isinstance(a, ast.Attribute)}
        if names & DEVICE_KINDS and attrs & {"kind", "type"}:
            lines.append(node.lineno)
    return lines


def _modules():
    return {str(p.relative_to(REPO)): p.read_text() for p in RUNTIME.rglob("*.py")}


def test_models_never_import_torch_distributed():
    offenders = {name: lines for name, source in _modules().items()
                 if name.startswith("runtime/models/") and (lines := distributed_imports(source))}
    assert not offenders, offenders


def test_only_collectives_and_topology_use_torch_distributed():
    offenders = {name: lines for name, source in _modules().items()
                 if name not in DISTRIBUTED_OWNERS and (lines := distributed_imports(source))}
    assert not offenders, offenders


def test_only_device_py_branches_on_the_device_kind():
    offenders = {name: lines for name, source in _modules().items()
                 if name != "runtime/device.py" and (lines := device_kind_branches(source))}
    assert not offenders, offenders


@pytest.mark.parametrize("checker, violation", [
    (distributed_imports, "import torch.distributed as dist\n"),
    (distributed_imports, "from torch import distributed\n"),
    (distributed_imports, "import torch\nx = torch.distributed.get_rank()\n"),
    (device_kind_branches, "if device.kind == 'cuda':\n    pass\n"),
    (device_kind_branches, "ok = t.device.type not in ('cpu', 'cuda')\n"),
])
def test_the_checkers_catch_a_deliberate_violation(checker, violation):
    assert checker(violation)
