"""One owner per fact (issue 59): the stage list, each instance type's hardware, torchrun's rendezvous ports, the exit
code of a user's mistake and the bytes of each dtype are each written once, and everything else reads that one
object. Each check scans the source (launcher/, runtime/, csp_tools/; the templates for the ports) for a literal
copy of its fact, and is shown a planted copy. tests/schema/test_one_owner.py holds the facts shared by the runtime
and the estimator (peak FLOP/s, the FLOPs formula, precision dtypes, the preemption exit code)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from launcher import instances
from runtime.schema import facts
from runtime.schema.stages import STAGES

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("launcher", "runtime", "csp_tools")
HARDWARE_NAMES = set(instances.INSTANCES) | set(instances.DEVICES)
PORTS = (instances.NEURON_RENDEZVOUS.base, instances.TORCHRUN_DEFAULT_PORT)


def _python(root: Path):
    for path in sorted(p for top in ROOTS for p in (root / top).rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text())


def _strings(nodes) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def stage_lists(root: Path) -> list[str]:
    """A tuple, list or set literal naming two stages or more, outside runtime/schema/stages.py."""
    return [f"{rel}:{node.lineno}" for rel, tree in _python(root) if rel != "runtime/schema/stages.py"
            for node in ast.walk(tree) if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            and len(set(_strings(node.elts)) & set(STAGES)) >= 2]


def _number(node) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
            ) or isinstance(node, ast.BinOp)


def hardware_tables(root: Path) -> list[str]:
    """A mapping literal from an instance type or device (trn1, trn2.48xlarge, h100...) to a number (chips, cores,
    memory, links...), outside launcher/instances.py and facts.PEAK_TFLOPS's module. (Which cluster preset a recipe
    target means is no hardware fact.)"""
    owners = ("launcher/instances.py", "runtime/schema/facts.py")
    return [f"{rel}:{node.lineno}" for rel, tree in _python(root) if rel not in owners
            for node in ast.walk(tree) if isinstance(node, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value in HARDWARE_NAMES and _number(v)
                    for k, v in zip(node.keys, node.values))]


def dtype_tables(root: Path) -> list[str]:
    """A mapping literal from a dtype name to a number of bytes, outside runtime/schema/facts.py."""
    return [f"{rel}:{node.lineno}" for rel, tree in _python(root) if rel != "runtime/schema/facts.py"
            for node in ast.walk(tree) if isinstance(node, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value in facts.DTYPE_BYTES and isinstance(v, ast.Constant)
                    and isinstance(v.value, int) for k, v in zip(node.keys, node.values))]


def user_error_exits(root: Path) -> list[str]:
    """`return 2`, `exit(2)` or `SystemExit(2)`: the code of a user's mistake spelled instead of read from
    facts.USER_ERROR_EXIT_CODE."""
    code = facts.USER_ERROR_EXIT_CODE

    def literal(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == code and not isinstance(node.value, bool)

    found = []
    for rel, tree in _python(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and node.value is not None and literal(node.value):
                found.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Call) and node.args and literal(node.args[0]) and (
                    getattr(node.func, "id", None) in ("exit", "SystemExit")
                    or getattr(node.func, "attr", None) == "exit"):
                found.append(f"{rel}:{node.lineno}")
    return found


def port_literals(root: Path) -> list[str]:
    """A rendezvous port (Neuron's base, torchrun's default) written outside launcher/instances.py, in code or in a
    job script's template."""
    pattern = re.compile(r"(?<![\d.])(" + "|".join(map(str, PORTS)) + r")(?![\d.])")
    files = [p for top in ROOTS for p in (root / top).rglob("*.py")] + list((root / "templates").rglob("*.j2"))
    return [f"{p.relative_to(root).as_posix()}:{n}" for p in sorted(files)
            if p.relative_to(root).as_posix() != "launcher/instances.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])]


CHECKS = [stage_lists, hardware_tables, dtype_tables, user_error_exits, port_literals]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_each_fact_is_written_once(check):
    assert check(REPO) == []


PLANTED = {
    stage_lists: ("launcher/x.py", 'ORDER = ("data_preparation", "training")\n'),
    hardware_tables: ("launcher/x.py", 'CHIPS = {"trn1": 16}\n'),
    dtype_tables: ("launcher/estimator/x.py", 'SIZE = {"bf16": 2}\n'),
    user_error_exits: ("runtime/x.py", "def main():\n    return 2\n"),
    port_literals: ("templates/x.sh.j2", "export MASTER_PORT=29500\n"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_a_planted_copy_is_found(check, tmp_path):
    for top in (*ROOTS, "templates"):
        (tmp_path / top).mkdir()
    (tmp_path / "launcher" / "fine.py").write_text('STAGE = "training"\nPORT = instances.NEURON\n')
    rel, text = PLANTED[check]
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(text)
    assert check(tmp_path) == [f"{rel}:{len(text.splitlines())}"]
