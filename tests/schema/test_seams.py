"""The schema's promises, as tests: the launcher, the schema and runtime/io (the staging program runs before any
stage's own environment matters) import no torch or numpy (head nodes and laptops have neither), neither when they
are imported nor inside any function of theirs or of a module they import, and each rule is written once (its
message appears in one source file)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Importing any of these must not load torch or numpy, even with torch installed (this environment has it).
BLOCKER = """
import importlib, importlib.abc, pkgutil, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'numpy'):
            raise ImportError(f'{name} imported by the launcher path')
sys.meta_path.insert(0, Block())
import launcher, runtime.schema, runtime.io
names = [m.name for pkg in (launcher, runtime.schema, runtime.io)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_launcher_schema_and_io_import_without_torch_or_numpy():
    result = subprocess.run([sys.executable, "-c", BLOCKER], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) > 40  # every launcher module and command, the whole schema, and runtime/io


def test_the_blocker_catches_a_violation():
    code = BLOCKER.replace("import launcher, runtime.schema, runtime.io",
                           "import launcher, runtime.schema, runtime.io, runtime.models")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "imported by the launcher path" in result.stderr


# The blocker sees what importing runs; an import inside a function runs only when the function is called (a launch
# that checks a file, a subcommand), on the head node all the same. So the source is read too: every module of the
# launch path, and every project module any of them imports anywhere, transitively (a package's __init__ with it),
# may not name torch or numpy in any import statement. TYPE_CHECKING imports never run and do not count.
PROJECT = ("launcher", "runtime", "csp_tools")
LAUNCH_PATH = ("launcher", "runtime.schema", "runtime.io")
HEAVY = ("torch", "numpy")


def _module_file(repo: Path, name: str) -> Path | None:
    path = repo.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth (functions, methods, branches), outside `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        skip = node.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) else []
        stack += [child for child in ast.iter_child_nodes(node) if child not in skip]


def _imported(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The modules an import statement may load (`from a import b`: a, and a.b when that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def family_protocols() -> list[str]:
    """The model families' standard-library modules the launcher reaches through the registry by name
    (runtime/schema/folder_families.py imports them with importlib, which no import statement shows): each folder's
    __init__ and its VARIANTS. Their model.py and weights.py are the runtime's, and may import torch."""
    from runtime.schema.folder_families import folder_family_modules, hf_families

    return sorted({module.__name__ for folder in folder_family_modules() for module in hf_families(folder)})


def launch_path_modules(repo: Path, roots=LAUNCH_PATH, modules: tuple[str, ...] | list[str] = ()) -> dict[str, Path]:
    """Every module of the `roots` packages and the named `modules`, and every project module they import
    (anywhere), transitively."""
    todo = list(modules)
    for root in roots:
        top = _module_file(repo, root).parent
        todo += [".".join(p.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
                 for p in top.rglob("*.py")]
    found: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        path = _module_file(repo, name)
        if name in found or path is None:
            continue
        found[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:n]) for n in range(1, len(parts))]  # `import a.b.c` runs a and a.b first
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            todo += [m for m in _imported(node, name, path.name == "__init__.py") if m.split(".")[0] in PROJECT]
    return found


def heavy_imports(repo: Path, roots=LAUNCH_PATH, modules: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`file:line imports module` for every torch or numpy import on the launch path."""
    offenders = []
    for name, path in sorted(launch_path_modules(repo, roots, modules).items()):
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            for module in _imported(node, name, path.name == "__init__.py"):
                if module.split(".")[0] in HEAVY:
                    offenders.append(f"{path.relative_to(repo)}:{node.lineno} imports {module}")
    return sorted(set(offenders))


def test_nothing_on_the_launch_path_imports_torch_or_numpy_even_inside_a_function():
    modules = launch_path_modules(REPO, modules=family_protocols())
    assert "runtime.schema.preference_pairs" in modules and "launcher.cli" in modules
    assert {"runtime.families.llama.mixtral", "runtime.families.gpt", "runtime.families.gemma3"} <= set(modules)
    assert not {"runtime.families.llama.model", "runtime.families.gpt.weights"} & set(modules)
    assert heavy_imports(REPO, modules=family_protocols()) == []


def test_the_source_check_catches_a_function_level_import(tmp_path):
    """A launcher module that imports numpy in a function; the schema reaching, inside a try in a function, a module
    that imports numpy (how a launch once depended on numpy being installed); an import under an `if` in a function:
    all named. A runtime module nothing on the launch path imports, and a TYPE_CHECKING import, are not."""
    files = {
        "launcher/__init__.py": "",
        "launcher/cli.py": "def main():\n    import numpy as np\n    return np\n",
        "runtime/__init__.py": "",
        "runtime/io/__init__.py": "",
        "runtime/schema/__init__.py": "",
        "runtime/schema/training.py": ("def long_prompt():\n    try:\n        from runtime.alignment.data import check\n"
                                       "    except ImportError:\n        return None\n    return check\n"),
        "runtime/schema/counts.py": "import json\n\n\ndef tokens():\n    if json:\n        from torch.nn import functional\n",
        "runtime/schema/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "runtime/alignment/__init__.py": "",
        "runtime/alignment/data.py": "import numpy as np\n",
        "runtime/models/__init__.py": "import torch\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert "runtime.alignment.data" in launch_path_modules(tmp_path)
    assert "runtime.models" not in launch_path_modules(tmp_path)
    assert heavy_imports(tmp_path) == ["launcher/cli.py:2 imports numpy",
                                       "runtime/alignment/data.py:1 imports numpy",
                                       "runtime/schema/counts.py:6 imports torch.nn",
                                       "runtime/schema/counts.py:6 imports torch.nn.functional"]


def _sources() -> dict[Path, str]:
    roots = [REPO / "launcher", REPO / "runtime", REPO / "csp_tools"]
    return {path: path.read_text() for root in roots for path in root.rglob("*.py")}


# The rules' modules: rules.py and the rules_*.py it imports back (each rule is rules.<name> to its callers).
RULE_FILES = sorted([REPO / "runtime/schema/rules.py", *(REPO / "runtime/schema").glob("rules_*.py")])
# A distinctive piece of each rule's message; the rules' modules must be the only source files that say it.
RULE_PHRASES = [name for path in RULE_FILES for name in re.findall(r"^def (\w+)\(", path.read_text(), re.M)]
PHRASES = [
    "is not divisible by tensor_model_parallel_size",
    "must divide trainer.devices",
    "is not divisible by micro_batch_size",
    "the interleaved schedule needs the micro-batch count",
    "needs pipeline_model_parallel_size > 1",
    "is fewer than the pipeline stages",
    "is not divisible by num_attention_heads",
    "does not divide num_attention_heads",
    "can be neither split over nor replicated",
    "tokens rounded up",
    "is smaller than encoder_seq_length",
    "differs from model.encoder_seq_length",
    "must be between 0 and model.optim.lr",
    "warmup_steps {warmup} exceeds trainer.max_steps",
    "the learning rate holds min_lr from step",
    "is not a Slurm time",
    "is not shorter than run.time_limit",
    "must be a whole number of steps",
    "use a positive count of",
    "each in [0, 1)",
    "is not an http:// or https:// URL",
    "must be > 0 and at most {MAX_RECORD_MB}",
    "which sbatch expands in #SBATCH --output",
]


@pytest.mark.parametrize("phrase", PHRASES)
def test_each_rule_is_written_once(phrase):
    holders = sorted(str(path.relative_to(REPO)) for path, text in _sources().items() if phrase in text)
    assert holders and all(REPO / holder in RULE_FILES for holder in holders), holders


def test_every_rule_function_is_used_by_a_parser():
    """A rule nobody calls would be a rule that is not checked."""
    text = "".join(t for p, t in _sources().items() if p.name != "rules.py" and p not in RULE_FILES)
    unused = [name for name in RULE_PHRASES if f"rules.{name}(" not in text and name not in ("world_text",)]
    assert not [n for n in unused if n not in ("slurm_seconds", "padded_vocab_size")], unused
