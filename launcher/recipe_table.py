"""docs/recipes.md's table: every training recipe on every target it names, as `nxdt-launch --dry-run` would
launch it (composed, every rule run, the memory checked by the estimator), one row each.

    python -m launcher.recipe_table          # prints the table; tests/recipes/test_recipe_table.py compares it

A recipe that sets `targets: null` is a target's own layout: it appears as the layout of its base's row. The tiny
recipes have no targets and run on this machine's CPU (cluster=local)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import UserError
from launcher.paths import conf_dir, group_choices
from launcher.targets import TARGETS, targets_of_file

if TYPE_CHECKING:
    from launcher.estimator import Layout

# target -> the cluster config that means it
CLUSTERS = {"trn1": "pcluster_trn1", "trn2": "pcluster_trn2", "gpu": "slurm", "cpu": "local"}
GIB = 2**30
DEMO_VOCAB = 4096


@dataclass(frozen=True)
class Row:
    recipe: str
    target: str
    layout: str          # the recipe that holds this target's layout (the recipe itself, or its variant)
    nodes: int
    workers: int         # per node
    parallel: str        # TP × PP (× VPP), CP, EP
    recompute: str
    batch: str           # micro-batch / global batch
    precision: str
    memory_gib: float    # per device, by the estimator
    usable_gib: float

    def markdown(self) -> str:
        return (f"| `{self.recipe}` | {self.target} | `{self.layout}` | {self.nodes} × {self.workers} | "
                f"{self.parallel} | {self.recompute} | {self.batch} | {self.precision} | "
                f"{self.memory_gib:.1f} / {self.usable_gib:.1f} |")


def pinned(recipe: str) -> bool:
    """A target's own layout (`targets: null` in its file)."""
    own, mapping = targets_of_file(recipe)
    return own and mapping is None


def _parallel(layout: Layout) -> str:
    text = f"TP {layout.tp} × PP {layout.pp}" + (f" × VPP {layout.vpp}" if layout.vpp > 1 else "")
    for size, name in ((layout.cp, "CP"), (layout.ep, "EP")):
        if size > 1:
            text += f", {name} {size}"
    return text + (", SP" if layout.sequence_parallel else "")


def _recompute(layout: Layout) -> str:
    if layout.recompute == "selective":
        return "selective (" + ", ".join(layout.recompute_modules) + ")"
    return layout.recompute or "none"


def row(recipe: str, target: str, results: Path, data: Path) -> Row:
    """The launch of `recipe` on `target`'s cluster, or the UserError that refuses it."""
    from launcher import launch
    from launcher.estimator import estimate

    plan = launch.make_plan([f"training={recipe}", f"cluster={CLUSTERS[target]}", "stages=[training]",
                             f"cluster_type={'local' if target == 'cpu' else 'slurm'}", f"base_results_dir={results}",
                             f"data_dir={data}"], dry_run=True, produced_by="docs/recipes.md")
    training = plan.config.stage("training").section  # the estimator reads the section (estimator/shapes.py)
    neuron = plan.config.cluster.neuron_hardware
    try:
        result = estimate(training, neuron_hardware=neuron, node_memory_bytes=64 * GIB)
    except UserError:  # the tiny recipes' demo tokenizer, built by data preparation: its 4096 tokens
        result = estimate(training, neuron_hardware=neuron, node_memory_bytes=64 * GIB, vocab_size=DEMO_VOCAB)
    name = (targets_of_file(recipe)[1] or {}).get(target) or recipe  # the recipe launch.make_plan composed
    layout = result.layout  # the estimator's typed reading of the training section
    return Row(recipe=recipe, target=target, layout=name, nodes=layout.num_nodes,
               workers=layout.devices_per_node, parallel=_parallel(layout), recompute=_recompute(layout),
               batch=f"{layout.micro_batch_size} / {layout.global_batch_size}",
               precision=layout.precision, memory_gib=result.memory.total / GIB,
               usable_gib=result.hardware.usable_bytes / GIB)


def targets_for(recipe: str) -> list[str]:
    """The targets a recipe launches on: trn1, trn2 and gpu for one that names layouts, else its own (cpu for the
    tiny recipes)."""
    from launcher.compose import compose

    if targets_of_file(recipe)[1] is not None:
        return list(TARGETS)
    return ["cpu" if compose([f"training={recipe}", "cluster=local"]).training.trainer.accelerator == "cpu"
            else "gpu"]


def rows() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        results, data = Path(tmp) / "results", Path(tmp) / "data"
        return [row(recipe, target, results, data) for recipe in group_choices("training") if not pinned(recipe)
                for target in targets_for(recipe)]


HEADER = ("| recipe | target | layout | nodes × workers | parallelism | recompute | micro / global batch | "
          "precision | GiB per device (est. / usable) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def markdown() -> str:
    return "\n".join([HEADER, *(r.markdown() for r in rows())]) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
