"""The schema's promises, as tests: the launcher, the schema and runtime/io (the staging program runs before any
stage's own environment matters) import no torch or numpy (head nodes and laptops have neither), and each rule is
written once (its message appears in one source file)."""

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


def _sources() -> dict[Path, str]:
    roots = [REPO / "launcher", REPO / "runtime", REPO / "csp_tools"]
    return {path: path.read_text() for root in roots for path in root.rglob("*.py")}


# A distinctive piece of each rule's message; rules.py must be the only source file that says it.
RULE_PHRASES = [name for name in re.findall(r"^def (\w+)\(", (REPO / "runtime/schema/rules.py").read_text(), re.M)]
PHRASES = [
    "is not divisible by tensor_model_parallel_size",
    "must divide trainer.devices",
    "is not divisible by micro_batch_size",
    "the interleaved schedule needs the micro-batch count",
    "needs pipeline_model_parallel_size > 1",
    "is not divisible by pipeline_model_parallel_size",
    "is not divisible by num_attention_heads",
    "does not divide num_attention_heads",
    "can be neither split over nor replicated",
    "tokens rounded up",
    "is smaller than encoder_seq_length",
    "differs from model.encoder_seq_length",
    "must be between 0 and model.optim.lr",
    "+ constant_steps {constant} exceeds",
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
    assert holders == ["runtime/schema/rules.py"], holders


def test_every_rule_function_is_used_by_a_parser():
    """A rule nobody calls would be a rule that is not checked."""
    text = "".join(t for p, t in _sources().items() if p.name != "rules.py")
    unused = [name for name in RULE_PHRASES if f"rules.{name}(" not in text and name not in ("world_text",)]
    assert not [n for n in unused if n not in ("slurm_seconds", "padded_vocab_size")], unused
