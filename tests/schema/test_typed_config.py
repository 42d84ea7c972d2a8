"""The launcher reads the composed config once, in launcher/config.py (the parse layer), and everything after it
reads the typed LaunchConfig and the schema's typed sections: no other launcher module looks up a key of the
composed config by name. Checked on the source (an AST scan for `x["key"]` and `x.get("key")` with a key the
launch config or the schema's trainer section owns), and shown a deliberate violation."""

import ast
from dataclasses import fields
from pathlib import Path

from launcher import config
from runtime.schema.training_config import TrainerConfig

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launcher"

# The keys whose raw reads are refused: the launch config's own (top level, each stage's run, the cluster group's,
# the stage names), the sections of a trainer stage the schema parses, and the trainer keys it sizes jobs by.
KEYS = (
    {f.name for f in fields(config.LaunchConfig)} - {"sections", "raw"}
    | {f.name for f in fields(config.Run)}
    | set(config.SBATCH_KEYS) | set(config.OTHER_CLUSTER_KEYS)
    | set(config.STAGES)
    | {"run", "trainer", "model", "exp_manager", "precision", "data", "tokenizer", "optim"}
    | {f.name for f in fields(TrainerConfig)}
)

# Where a raw read is the point: the parse layers, and readers of documents that are not the composed config.
NOT_THE_COMPOSED_CONFIG = {
    "config.py": "the parse layer itself",
    "nxdt_config.py": "parses an NxD Training YAML file (training=@FILE) into our keys",
    "nemo_config.py": "parses a NeMo-Launcher YAML file (training=@FILE) into our keys",
    "nxdt_mapping.py": "maps each key of an NxD Training YAML file (training=@FILE) into our keys (nxdt_config.py's)",
    "nxdt_base.py": "fills in what an NxD Training YAML file leaves out, under our keys (nxdt_config.py's)",
    "resolvers.py": "OmegaConf resolvers, run by Hydra while it composes, before there is a config to parse",
    "targets.py": "edits the Hydra tree while it composes (which layout a recipe names for the cluster)",
    "plain_compose.py": "composes conf/ as Hydra does (a cache miss), before there is a config to parse",
    "plain_resolve.py": "resolves that composed tree's interpolations as OmegaConf does, before it is parsed",
    "pcluster.py": "composes and reads conf/pcluster/, the ParallelCluster config, not a launch",
    "records.py": "reads and writes our own launch records (JSON)",
    "titan_module.py": "renders the torchtitan job module from its own context (launcher/titan.py builds it)",
    "runs.py": "reads our own launch records (status, logs, cancel)",
    "completion.py": "click's parameters (--results-dir) while completing a run name",
}

# Names that hold a launch record (records.py) or one stage's entry of it, never the config (`record[...]`,
# `trial.record[...]`).
RECORD_NAMES = {"record", "entry"}


def _is_click_context(node: ast.AST) -> bool:
    """`ctx.obj`: click's context object (the global --dry-run), not the config."""
    return isinstance(node, ast.Attribute) and node.attr == "obj" and isinstance(node.value, ast.Name) \
        and node.value.id == "ctx"


# Functions that read keys of a config by name that is not a launch's, each with why. What the launch checks
# before the schema's full reading (the data, tokenizer and checkpoint paths a dry run cannot open), the trainer's
# values as given and what shapes a stage's graphs are read by the parse layer (config.StageInputs).
FUNCTIONS = {
    "autoconfig/driver.py:read_search": "search_config's name and results_dir: the search's own config, not a launch",
}


def raw_reads(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, key) of every `x["key"]` or `x.get/pop/setdefault("key", ...)` with a key in
    KEYS, unless x is a launch record."""
    found = []

    def receiver_is_record(node: ast.AST) -> bool:
        if isinstance(node, ast.BoolOp):  # `(ctx.obj or {})`
            node = node.values[0]
        return (isinstance(node, ast.Name) and node.id in RECORD_NAMES
                or isinstance(node, ast.Attribute) and node.attr in RECORD_NAMES
                or _is_click_context(node))

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not function \
                else function
            key = None
            if isinstance(child, ast.Subscript) and isinstance(child.slice, ast.Constant) \
                    and not receiver_is_record(child.value):
                key = child.slice.value
            elif isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in ("get", "pop", "setdefault") and child.args \
                    and isinstance(child.args[0], ast.Constant) and not receiver_is_record(child.func.value):
                key = child.args[0].value
            if isinstance(key, str) and key in KEYS:
                found.append((child.lineno, inner, key))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def test_no_launcher_module_reads_the_composed_config_by_key():
    problems = []
    for path in sorted(LAUNCHER.rglob("*.py")):
        name = path.relative_to(LAUNCHER).as_posix()
        if name in NOT_THE_COMPOSED_CONFIG:
            continue
        for line, function, key in raw_reads(path.read_text()):
            if f"{name}:{function}" not in FUNCTIONS:
                problems.append(f"launcher/{name}:{line} ({function or 'module'}) reads {key!r} by name; "
                                "read it from the LaunchConfig (launcher/config.py)")
    assert not problems, "\n".join(problems)


def test_every_exemption_names_a_module_or_function_that_exists():
    """An allowance outlives its reason silently; one that names nothing is removed."""
    for name in [*NOT_THE_COMPOSED_CONFIG, *(f.split(":")[0] for f in FUNCTIONS)]:
        assert (LAUNCHER / name).is_file(), name
    for entry in FUNCTIONS:
        name, function = entry.split(":")
        reads = raw_reads((LAUNCHER / name).read_text())
        assert any(f == function for _, f, _ in reads), f"{entry} reads no key by name now: drop it"
    for name in NOT_THE_COMPOSED_CONFIG:
        assert raw_reads((LAUNCHER / name).read_text()), f"{name} reads no key by name now: drop it"


def test_the_scan_catches_a_deliberate_violation():
    snippet = '''
def build(cfg, job):
    nodes = cfg["training"]["trainer"]["num_nodes"]
    partition = (cfg.get("cluster") or {}).get("partition")
    state = record["stages"]          # a launch record, not the config
    dry_run = (ctx.obj or {}).get("dry_run")   # click's context object, not the config
    return nodes, partition, job.options["unrelated"]
'''
    assert sorted((line, key) for line, _, key in raw_reads(snippet)) == [
        (3, "num_nodes"), (3, "trainer"), (3, "training"), (4, "cluster"), (4, "partition")]
    assert {function for _, function, _ in raw_reads(snippet)} == {"build"}


def test_a_launch_reads_each_trainer_stages_layout_once(monkeypatch, tmp_path):
    """Followed from the CLI's plan through validation, the memory check and the plan table's host-memory line: the
    schema's reader of tensor_model_parallel_size and the rest of the layout (read_parallel) runs once per trainer
    stage, and the estimate the launch prints is the one its memory check judged."""
    from launcher import launch
    from launcher.memory_fit import host_memory_note
    from runtime.schema import training, training_layout

    calls = []
    real = training_layout.read_parallel

    def counted(model):
        calls.append(model.path)
        return real(model)

    for module in (training, training_layout):
        monkeypatch.setattr(module, "read_parallel", counted)
    monkeypatch.chdir(tmp_path)
    plan = launch.make_plan(["stages=[training,fine_tuning]", "training=llama3/8b", "fine_tuning=llama3/8b",
                             "cluster=pcluster_trn1", "cluster_type=slurm"], dry_run=True, produced_by="test")
    notes = [host_memory_note(plan.estimates.get(job.stage), job.stage) for job in plan.jobs]
    assert sorted(calls) == ["fine_tuning.model", "training.model"]
    # fine_tuning's Hugging Face weights are not on this machine: no vocabulary to estimate by, and no line.
    assert set(plan.estimates) == {"training"} and notes[0].startswith("host memory per node (training): 32 workers")
