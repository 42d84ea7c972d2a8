"""Files you can read whole (issue 59): no source file of launcher/, runtime/ or csp_tools/ over 500 lines, and no
function over 80 (its `def` line to its last, decorators left out). A part that grows past either is split along a
seam of its own (a section, a phase, a table of handlers) when it grows, not later. Checked on the tree, and on a
deliberate violation."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("launcher", "runtime", "csp_tools")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def oversized(root: Path) -> list[str]:
    """Each file over MAX_FILE_LINES and each function over MAX_FUNCTION_LINES under root's ROOTS."""
    found = []
    for path in sorted(p for top in ROOTS for p in (root / top).rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        if (lines := len(text.splitlines())) > MAX_FILE_LINES:
            found.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_file_over_500_lines_and_no_function_over_80():
    assert oversized(REPO) == []


def test_the_check_catches_a_long_file_and_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "long.py").write_text(f"def ok():\n    pass\n\n\ndef long():\n{body}\n" + "\n" * 420)
    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "short.py").write_text("def f():\n    return 1\n")
    assert oversized(tmp_path) == ["runtime/long.py: 505 lines", "runtime/long.py:5 long: 81 lines"]
