"""The launch's memory checks: a trainer stage's layout against the memory of the cluster's nodes, by the
estimator (launcher/estimator/), refused at launch rather than after the queue wait. Device memory per device and
host memory per node, each problem one line with the arithmetic and the fixes. launcher/validate.py runs them among
its checks and exports them under its own names; autoconfig ranks its layouts by the same rule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.config import Cluster, LaunchConfig
from runtime.schema import rules

if TYPE_CHECKING:
    from launcher.estimator import Estimate
    from launcher.estimator.host import HostMemory
    from runtime.schema.training_config import SizingConfig, TrainerConfig


def memory_fit(cfg: LaunchConfig, stage: str = "training", *, local: bool, sizing: SizingConfig | None = None,
               keep: dict[str, Estimate] | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a trainer stage's layout against memory (stage_memory_fit), refused here rather than
    after the queue wait. `local`: the local executor runs the workers on this machine. `sizing`: the schema's
    reading of the stage that validate made; `keep`: where the estimate is kept for the launch (host_memory_note)."""
    section = cfg.stage(stage)
    if section.trainer is None:
        return [], []
    return stage_memory_fit(section.section, stage, cfg.cluster, local=local, trainer=section.trainer,
                            sizing=sizing, keep=keep)


def stage_memory_fit(section: dict[str, Any], stage: str, cluster: Cluster, *, local: bool,
                     vocab_size: int | None = None, trainer: TrainerConfig | None = None,
                     sizing: SizingConfig | None = None, keep: dict[str, Estimate] | None = None
                     ) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a trainer stage's config (`section`, as composed) on `cluster`'s nodes, by the
    estimator: the launch's rule, which autoconfig ranks its layouts by too. Host memory per node (every trainer
    stage): the workers' shards, checkpoint staging, data and process overhead together need more than the node
    has: an error. Which node memory applies: cluster.node_memory_gib when it states one; else, for an accelerator,
    the instance's documented memory; for CPU, this machine's where the local executor runs the workers here, and
    none on Slurm (this machine's memory says nothing of a Slurm node's: not judged). On CPU the device is the host:
    the activations count too, as a warning. Device memory (every trainer stage on a GPU or NeuronCore): weights,
    gradients and optimizer state (under LoRA the frozen weights alone) need more than the device has: an error;
    activations on top of that are a warning, as the estimator's activation model is an upper bound (NxD Training's
    published Llama 3 70B layout runs on trn1 and reads 18.6 of 13.9 GiB). A vocabulary the estimator cannot know
    here (no tokenizer file, no `vocab_size`): not judged. `trainer`: the launch's reading of the stage's trainer
    section (launcher/config.py), not read again."""
    result = _estimate(section, cluster, vocab_size, stage, trainer, sizing)
    if result is None:
        return [], []
    if keep is not None:
        keep[stage] = result
    # The vocabulary as the estimator read it (a tokenizer this launch's data_preparation would otherwise make is
    # not read by the schema): an absurd one is refused here even where no node memory is known to judge it by.
    tokenizer = result.sizing.tokenizer_path
    if problem := rules.vocab_rows(result.shape.vocab_size, f"{stage}.model.tokenizer.model",
                                   repr(tokenizer) if tokenizer else "its tokenizer"):
        return [problem], []
    fixes = ("(nxdt-launch estimate training=... shows where the memory goes; docs/recipes.md lists each recipe's "
             "layouts)")
    errors, warnings = [], []
    on_cpu = result.hardware.name == "cpu"
    # More workers than the node has devices is refused on its own (launcher/neuron.py): judging the node's host
    # memory for workers it cannot run would only repeat that mistake as a second, misleading one.
    if on_cpu or result.layout.devices_per_node <= result.hardware.devices_per_node:
        known = not on_cpu or local or cluster.node_memory_bytes is not None
        errors, warnings = host_memory_fit(result.host, stage, on_cpu=on_cpu, known=known)
    if on_cpu:
        return errors, warnings
    gib, memory, usable = 2**30, result.memory, result.hardware.usable_bytes
    where = f"the {usable / gib:.1f} GiB usable on {result.hardware.description}"
    if memory.static > usable:
        # LoRA's frozen weights keep no gradients or optimizer state (zero1 would shard nothing).
        state, zero1 = (("weights (frozen under LoRA)", "") if memory.optimizer == 0 else
                        ("weights, gradients and optimizer state",
                         ", or shard them over data parallelism: zero_stage=1 (optimizer state), 2 (and gradients) "
                         "or 3 (and weights)"))
        errors.append(f"{stage}.model: {state} need {memory.static / gib:.1f} GiB per device by the estimator, more "
                      f"than {where}; raise tensor_model_parallel_size or pipeline_model_parallel_size{zero1} "
                      f"{fixes}")
    elif memory.total > usable:
        warnings.append(f"{stage}.model: this layout needs {memory.total / gib:.1f} GiB per device by the estimator "
                        f"(activations {memory.activations / gib:.1f}), more than {where}; if it runs out of memory, "
                        f"set activations_checkpoint_granularity=full or raise the parallel sizes {fixes}")
    return errors, warnings


def _estimate(section: dict[str, Any], cluster: Cluster, vocab_size: int | None = None, stage: str = "training",
              trainer: TrainerConfig | None = None, sizing: SizingConfig | None = None):
    """The estimator's reading of a trainer stage's config on the cluster's nodes; None where the estimator cannot
    size it here (no tokenizer file for the vocabulary)."""
    from launcher.errors import UserError
    from launcher.estimator import estimate

    try:
        return estimate(section, neuron_hardware=cluster.neuron_hardware, node_memory_bytes=cluster.node_memory_bytes,
                        vocab_size=vocab_size, stage=stage, trainer=trainer, sizing=sizing)
    except UserError:
        return None


def host_memory_note(result: Estimate | None, stage: str) -> str | None:
    """What the launch prints for a trainer stage: host memory per node, from the estimate memory_fit judged it by
    (the launch's `estimates`)."""
    if result is None:
        return None
    host = result.host
    peer = "" if not host.peer_every else (
        f"; peer-held state every {host.peer_every} step(s): {host.peer_store_per_node / 2**30:.2f} GiB per node in "
        f"its peer store and {(host.peer - host.peer_store_per_node / host.workers) / 2**30:.2f} GiB per worker "
        f"for its copy, counted above")
    return f"host memory per node ({stage}): {host.arithmetic(static=True)}{peer}"


def host_memory_fit(host: HostMemory, stage: str, *, on_cpu: bool, known: bool) -> tuple[list[str], list[str]]:
    """(errors, warnings) of host memory per node (launcher/estimator/host.py's HostMemory): one line each, with
    the arithmetic and the fixes. `known`: the node's memory is (stated, an instance's, or this machine's for a
    local run); a CPU node's that is not is not judged."""
    if on_cpu and not known:
        return [], []
    shown = " (nxdt-launch estimate training=... shows the breakdown)" if stage == "training" else ""
    fixes = (f"raise {stage}.model.tensor_model_parallel_size or pipeline_model_parallel_size (smaller shards per "
             f"worker), lower {stage}.trainer.devices (fewer workers per node), or set cluster.node_memory_gib if the "
             f"nodes have more{shown}")
    if host.static_total > host.usable_bytes:
        return [f"{stage}.model: host memory per node by the estimator: {host.arithmetic(static=True)}; {fixes}"], []
    if host.total > host.usable_bytes:
        return [], [f"{stage}.model: host memory per node with the activations (the device is the host) by the "
                    f"estimator: {host.arithmetic()}; if it runs out of memory, set "
                    f"activations_checkpoint_granularity=full, or {fixes}"]
    return [], []
