# Memory per device, host memory per node and time to train for a training config, from arithmetic alone (no torch,
# nothing run).
#
#     from launcher.estimator import estimate
#     result = estimate(cfg["training"])          # the resolved training subtree, as nxdt-launch composes it
#     result.memory.total, result.fits, result.host.total, result.host.fits, result.days
#
# Modules: hardware (devices and their nodes), shapes (model/layout from the config, parameter counts), memory (per
# device), host (host memory per node: every worker's own shard, checkpoint staging, data, process), compute (FLOPs,
# step time, time to train). `nxdt-launch estimate` prints it; autoconfig ranks layouts with it.
# Every part is a pure function of (ModelShape, Layout): peak_memory(shape, layout, kernels).activations is what a
# benchmark compares with a measurement, for any tp / pp / ep / context-parallel (cp, ulysses) layout.
from __future__ import annotations

import dataclasses
from typing import Any

from launcher.errors import UserError
from launcher.estimator.compute import StepTime, days_to_train, flops_per_token, step_time
from launcher.estimator.hardware import Hardware, detect, hardware_for
from launcher.estimator.host import HostMemory, host_memory
from launcher.estimator.memory import Kernels, StageMemory, peak_memory
from launcher.estimator.shapes import (Layout, ModelShape, ParameterCount, count_parameters, layout_from_training,
                                       shape_from_training, vocab_for)
from runtime.schema.stages import PAIR_STAGES
from runtime.schema.reader import Report, Section
from runtime.schema.training import parse_fault_tolerance, parse_lora, parse_sizing, parse_trainer
from runtime.schema.training_config import SizingConfig, TrainerConfig


@dataclasses.dataclass(frozen=True)
class Estimate:
    shape: ModelShape
    layout: Layout
    hardware: Hardware
    parameters: ParameterCount
    memory: StageMemory          # the device with the most memory
    host: HostMemory             # host memory per node, for the worker that holds the most
    mfu: float
    tokens: float                # the token budget the time is for
    flops_per_token: float
    step: StepTime               # the layout-aware step-time model
    # The schema's reading of the config it estimates (parse_sizing): the input, not part of the estimate.
    sizing: SizingConfig = dataclasses.field(compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.usable_bytes

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.layout.global_batch_size * self.shape.seq_length

    @property
    def step_seconds_at_mfu(self) -> float:
        return self.flops_per_step / (self.layout.world_size * self.hardware.peak_tflops * 1e12 * self.mfu)

    @property
    def days(self) -> float:
        return days_to_train(self.shape, self.tokens, self.layout.world_size, self.hardware, self.mfu)


def estimate(training: dict[str, Any], *, device: str | None = None, tokens: float | None = None,
             mfu: float | None = None, vocab_size: int | None = None, node_memory_bytes: float | None = None,
             neuron_hardware: str | None = None, stage: str = "training", sizing: SizingConfig | None = None,
             trainer: TrainerConfig | None = None) -> Estimate:
    """Estimate a resolved trainer stage's config (training, fine_tuning, peft or alignment: `stage`). The device is
    `device`, else the cluster's neuron.hardware (trn1 | trn2) for a neuron recipe, else detected from
    trainer.accelerator and trainer.devices. `tokens` defaults to the run's own budget, max_steps x global_batch_size
    x seq_length. `node_memory_bytes`: the node's host memory (cluster.node_memory_gib); None: the instance's
    documented memory (hardware.NODE_MEMORY_GIB), or for cpu this machine's. LoRA (model.peft) trains adapters over
    frozen weights; alignment's micro-batch of m pairs is 2m rows through the model (chosen, rejected), its
    reference log-probabilities computed once before training by the same weights (no second model). `sizing` and
    `trainer`: the schema's readings of `training` where the caller has them already (parse_sizing without errors,
    parse_trainer), so the config is read once; read here otherwise."""
    sizing_report = Report()
    if sizing is None:
        sizing, sizing_report = parse_sizing(training)  # the schema's reading of what the run is sized by
    shape = shape_from_training(sizing, vocab_for(sizing, vocab_size))
    if trainer is None:
        trainer, report = parse_trainer(training)  # the schema's reading, as the launch sizes the job by
        if trainer is None:
            raise UserError(*report.errors)
    if sizing_report.errors:
        raise UserError(*sizing_report.errors)
    layout = layout_from_training(sizing, trainer)
    # rl: the batch sizes count completions, each a row through the model (its rollouts' forwards, generation and
    # the optimizer step's, are not sized apart).
    if stage in PAIR_STAGES:  # alignment and rlhf_rm: m pairs are 2m rows
        layout = dataclasses.replace(layout, micro_batch_size=2 * layout.micro_batch_size,
                                     global_batch_size=2 * layout.global_batch_size)
    accelerator = trainer.accelerator
    if device is None and accelerator == "neuron" and neuron_hardware in ("trn1", "trn2"):
        device = neuron_hardware
    hardware = hardware_for(device or detect(accelerator, layout.devices_per_node), layout.devices_per_node,
                            node_memory_bytes)
    mfu = float(mfu if mfu is not None else hardware.default_mfu)
    if tokens is None:
        tokens = float(trainer.max_steps) * layout.global_batch_size * shape.seq_length
    kernels = Kernels.for_accelerator(shape, "cpu" if hardware.name == "cpu" else accelerator)
    # The schema's reading of model.peft: LoRA trains adapters over frozen weights (host memory counts that).
    lora = parse_lora(Section(sizing.model, "model", Report()), shape.architecture, "") is not None
    ft = parse_fault_tolerance(training, "")[0]
    peer_every = ft.peer_state_every_n_steps if ft is not None and ft.enabled else 0
    return Estimate(shape=shape, layout=layout, hardware=hardware, parameters=count_parameters(shape),
                    memory=peak_memory(shape, layout, kernels, lora=lora),
                    host=host_memory(shape, layout, hardware, kernels, lora=lora, peer_every=peer_every), mfu=mfu, tokens=float(tokens),
                    flops_per_token=flops_per_token(shape), step=step_time(shape, layout, hardware, mfu),
                    sizing=sizing)


__all__ = ["Estimate", "Hardware", "HostMemory", "Kernels", "Layout", "ModelShape", "ParameterCount", "StageMemory",
           "StepTime", "count_parameters", "estimate", "flops_per_token", "host_memory", "layout_from_training",
           "peak_memory", "shape_from_training", "step_time"]
