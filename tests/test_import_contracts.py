"""The seams docs/architecture.md promises, checked on the source (ast, no imports), so they cannot drift:
models never import torch.distributed; only the collectives and topology modules do (pipeline p2p goes through
collectives); only runtime/device.py compares device kinds; no two of the project's modules import each other,
however indirectly, and no two parts of one package either (a subpackage counted as one part). Each checker is also
shown a violation."""

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime"
# runtime/torchrun.py is torch's launch agent (torch.distributed.run), not a process-group user.
# runtime/convert/titan.py reads and writes torchtitan's checkpoints with torch.distributed.checkpoint as a file
# format (no process group: no_dist=True), not as a process-group user either.
DISTRIBUTED_OWNERS = {"runtime/parallel/collectives.py", "runtime/parallel/topology.py", "runtime/torchrun.py",
                      "runtime/convert/titan.py"}
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


# --------------------------------------------------------------------------------------------- import circles
# The import graph is grimp's (the engine of import-linter): every import statement of the three packages, those
# inside functions included. A function-level import that "breaks" a circle still means two modules that need
# each other: the circle is only moved to the first call. TYPE_CHECKING imports never run, and do not count.
PACKAGES = ("launcher", "runtime", "csp_tools")

# Imports that may close a circle, until the code they sit in is reworked; each names why it is here.
# Allowances, (importer, imported) edges, for both checks (module circles and circles between a package's parts):
# none today.
KNOWN_CIRCLES: set[tuple[str, str]] = set()


def _grimp():
    try:
        import grimp
    except ImportError:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set but grimp is missing (pip install -e '.[test]')", pytrace=False)
        pytest.skip("grimp not installed (pip install -e '.[test]')")
    return grimp


def import_graph():
    graph = _grimp().build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    # `import a.b.c` runs a/__init__.py and a/b/__init__.py first: to Python it imports those packages too
    # (those that hold the importer are already running, and add nothing).
    implied = {(importer, package) for importer in graph.modules
               for imported in graph.find_modules_directly_imported_by(importer)
               for package in _packages_of(imported)
               if package != importer and not importer.startswith(package + ".")}
    for importer, package in implied:
        graph.add_import(importer=importer, imported=package)
    return graph


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def import_circles(graph, allowed=frozenset()) -> list[str]:
    """Every circle once, shortest first, as `a -> b -> ... -> a`, after removing the allowed imports."""
    for importer, imported in allowed:
        graph.remove_import(importer=importer, imported=imported)
    found: dict[frozenset, tuple[str, ...]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.setdefault(frozenset(back), (importer, *back))
    return [" -> ".join(circle) for circle in sorted(found.values(), key=lambda c: (len(c), c))]


def package_circles(graph, allowed=frozenset()) -> list[str]:
    """Circles among the parts of each package, a part being one of its modules or a whole subpackage: `a -> b -> a`
    where a's modules import b's and b's import a's. runtime.convert.peft -> runtime.finetune -> runtime.convert.hf
    is no circle of modules, yet it makes runtime/convert/ and runtime/finetune.py need each other: a layer that
    imports the layer above it. Listed as the parts' circle, then the import that closes it."""
    for importer, imported in allowed:
        if graph.direct_import_exists(importer=importer, imported=imported):
            graph.remove_import(importer=importer, imported=imported)
    found: dict[frozenset, str] = {}
    for package in sorted({m.rpartition(".")[0] for m in graph.modules if "." in m}):
        edges: dict[str, dict[str, tuple[str, str]]] = {}  # part -> part it imports -> one import that does it
        for importer in graph.find_descendants(package):
            for imported in graph.find_modules_directly_imported_by(importer):
                a, b = _part(package, importer), _part(package, imported)
                if b is not None and a != b:
                    edges.setdefault(a, {}).setdefault(b, (importer, imported))
        for a in sorted(edges):
            for b in sorted(edges[a]):
                back = _shortest_path(edges, b, a)
                if back:
                    evidence = edges[back[-2]][a]
                    found.setdefault(frozenset(back), f"{' -> '.join((a, *back))} (closed by {evidence[0]} -> "
                                                         f"{evidence[1]})")
    return sorted(found.values(), key=lambda c: (c.count(" -> "), c))


def _part(package: str, module: str) -> str | None:
    """The part of `package` that holds `module`: its child module or subpackage; None outside it."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1:].split('.')[0]}"


def _shortest_path(edges: dict[str, dict], start: str, goal: str) -> list[str] | None:
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        if path[-1] == goal:
            return path
        for step in sorted(edges.get(path[-1], ())):
            if step not in seen:
                seen.add(step)
                paths.append(path + [step])
    return None


def test_no_import_circles():
    assert import_circles(import_graph(), KNOWN_CIRCLES) == []


def test_no_circles_between_the_parts_of_a_package():
    assert package_circles(import_graph(), KNOWN_CIRCLES) == []


def test_each_known_circle_is_still_a_circle():
    """An allowance that closes no circle any more would let one come back unseen: delete it instead."""
    graph = import_graph()
    stale = [(importer, imported) for importer, imported in KNOWN_CIRCLES
             if not graph.direct_import_exists(importer=importer, imported=imported)
             or not graph.find_shortest_chain(importer=imported, imported=importer)]
    assert not stale, f"delete these from KNOWN_CIRCLES: {stale}"


@pytest.mark.parametrize("importer, imported", [
    # The circle this check was written after: the node's staging program importing the launcher's planner.
    ("runtime.io.s3", "launcher.staging"),
    # One only through a package's __init__: runtime.io.s3 imports runtime.schema.s3, so runtime/schema/__init__.py,
    # which imports runtime.schema.reader.
    ("runtime.schema.reader", "runtime.io.s3"),
])
def test_the_circle_check_catches_a_deliberate_violation(importer, imported):
    graph = import_graph()
    graph.add_import(importer=importer, imported=imported)
    circles = [circle.split(" -> ") for circle in import_circles(graph, KNOWN_CIRCLES)]
    assert any((importer, imported) in zip(c, c[1:]) for c in circles), circles


@pytest.mark.parametrize("importer, imported, parts", [
    # The circle this check was written after: the LoRA export reading starting weights through fine-tuning, which
    # reads them through conversion.
    ("runtime.convert.peft", "runtime.finetune", ("runtime.convert", "runtime.finetune")),
    # The schema, which the launcher imports, asking the alignment stage's numpy dataset to check a file.
    ("runtime.schema.training", "runtime.alignment.data", ("runtime.schema", "runtime.alignment")),
])
def test_the_package_circle_check_catches_a_deliberate_violation(importer, imported, parts):
    graph = import_graph()
    graph.add_import(importer=importer, imported=imported)
    circles = package_circles(graph, KNOWN_CIRCLES)
    assert any(all(f"{part} -> " in circle for part in parts) for circle in circles), circles
    # No two modules need each other in either: the module check alone misses both.
    graph = import_graph()
    graph.add_import(importer=importer, imported=imported)
    assert import_circles(graph, KNOWN_CIRCLES) == []
