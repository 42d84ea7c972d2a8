"""The host-memory check each shipped recipe's own test runs on the config it has composed (tests/recipes/
test_recipes.py, tests/launcher/test_fine_tuning_stages.py, tests/launcher/test_alignment_stages.py): the launch's
rule (launcher/memory_fit.py host_memory_fit) on the estimator's numbers, against the node memory of the recipe's
cluster, or for a CPU recipe a 64 GiB node (a Slurm node's memory is not this machine's; the recipe tests assume
the same)."""

from __future__ import annotations

import copy

from launcher.config import parse_cluster
from launcher.estimator import estimate
from launcher.validate import host_memory_fit

GIB = 2**30
CPU_NODE_GIB = 64


def host_memory_problems(cfg: dict, stage: str, vocab_size: int | None = None) -> list[str]:
    """Errors and warnings of `stage`'s host memory per node in the composed launch config `cfg`, each with its
    arithmetic; [] when it fits."""
    nodes = parse_cluster(cfg.get("cluster"))
    stated = nodes.node_memory_bytes

    def sized(node_memory_bytes):
        return estimate(copy.deepcopy(cfg[stage]), neuron_hardware=nodes.neuron_hardware,
                        node_memory_bytes=node_memory_bytes, vocab_size=vocab_size, stage=stage)

    result = sized(stated)
    if result.hardware.name == "cpu" and stated is None:
        result = sized(CPU_NODE_GIB * GIB)
    errors, warnings = host_memory_fit(result.host, stage, on_cpu=result.hardware.name == "cpu", known=True)
    return errors + warnings
