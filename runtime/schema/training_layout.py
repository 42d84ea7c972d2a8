"""The parallel layout in a training stage config (model.tensor_model_parallel_size and the other sizes,
activation checkpointing, pipeline cuts), and its rules against the trainer's world (under run.elastic, one node
smaller too), the batch and the model."""
from __future__ import annotations

import dataclasses

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.model import MoEConfig
from runtime.schema.reader import Report, Section
from runtime.schema.training_config import DataConfig, ParallelConfig, TrainerConfig


def read_parallel(model: Section) -> ParallelConfig | None:
    recompute = model.raw("activations_checkpoint_recompute", [])
    modules: list[str] = []
    if not isinstance(recompute, (list, tuple)):
        model.report.error(f"{model.key('activations_checkpoint_recompute')}: {recompute!r} must be a list of "
                           f"{C.RECOMPUTE_MODULES.listing()}")
    else:
        for i, name in enumerate(recompute):
            problem = C.RECOMPUTE_MODULES.problem(model.key(f"activations_checkpoint_recompute[{i}]"), name)
            model.report.error(problem)
            if problem is None:
                modules.append(C.RECOMPUTE_MODULES.canonical(name))
    values = dict(
        tp=model.int("tensor_model_parallel_size", 1, minimum=1),
        pp=model.int("pipeline_model_parallel_size", 1, minimum=1),
        ep=model.int("expert_model_parallel_size", 1, minimum=1),
        cp=model.int("context_parallel_size", 1, minimum=1),
        ulysses=model.int("ulysses_parallel_size", 1, minimum=1),
        sequence_parallel=model.bool("sequence_parallel", False),
        # Megatron-core's DDP names; NeMo's optim.overlap_grad_sync / overlap_param_sync map onto them.
        overlap_grad_reduce=model.bool("overlap_grad_reduce", True),  # as torch DDP and Megatron-core default
        overlap_param_gather=model.bool("overlap_param_gather", True),
    )
    vpp = model.int("virtual_pipeline_model_parallel_size", None, minimum=1)
    # model.zero1 (NxD / NeMo) and model.zero_stage (Megatron-DeepSpeed): one setting, rules.zero_stage.
    zero1, stage = model.bool("zero1", None), model.int("zero_stage", None)
    problem = rules.zero_stage(stage, zero1, model.path.removesuffix("model"))
    model.report.error(problem)
    values["zero_stage"] = (stage if stage is not None else int(bool(zero1))) if problem is None else None
    granularity = model.choice("activations_checkpoint_granularity", C.CHECKPOINT_GRANULARITIES, None)
    cuts = _pipeline_cuts(model)
    shard_degree = model.int("data_parallel_shard_degree", None)  # torchtitan's name; hybrid: rules.shard_degree
    if any(v is None for v in values.values()):
        return None
    values["zero1"], values["shard_degree"] = values["zero_stage"] >= 1, shard_degree
    return ParallelConfig(virtual_pp=vpp, activation_checkpointing=granularity,
                          recompute_modules=tuple(dict.fromkeys(modules)), pipeline_cuts=cuts, **values)


def _pipeline_cuts(model: Section) -> tuple[int, ...] | None:
    """model.pipeline_cuts as layer indices: NxD Training writes module names ("model.layers.18"), a number is
    the same layer. Their count and order are the layout rule's (rules.layers_split)."""
    raw = model.raw("pipeline_cuts", None)
    if raw is None:
        return None
    cuts = []
    for item in raw if isinstance(raw, list) else [raw]:
        text = str(item).removeprefix("model.").removeprefix("layers.") if not isinstance(item, bool) else ""
        if not text.isdigit():
            model.report.error(f"{model.key('pipeline_cuts')}: {raw!r} must be a list of layer indices or names "
                               f"(model.layers.N), the last layer of each pipeline stage but the last")
            return None
        cuts.append(int(text))
    return tuple(cuts)


def layout_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig, data: DataConfig | None):
    tp, pp, vpp = parallel.tp, parallel.pp, parallel.virtual_pp
    world = trainer.num_nodes * trainer.devices
    report.error(rules.world_divisible(world, rules.world_text(trainer.num_nodes, trainer.devices), tp, pp, p))
    report.error(rules.tp_within_node(tp, trainer.devices, p))
    report.error(rules.virtual_needs_pipeline(vpp, pp, p))
    report.error(rules.zero3_on_xla(parallel.stage, trainer.accelerator, p))
    if world % (tp * pp) == 0 and world // (tp * pp) % parallel.ep == 0:  # otherwise the expert rules say so
        dp = world // (tp * pp)
        report.error(rules.shard_degree(parallel.shard_degree, parallel.stage, dp, dp // parallel.ep, p))
    if data is None or world % (tp * pp):
        return
    dp = world // (tp * pp)
    if dp % parallel.context:
        return  # the context rules say so
    dp //= parallel.context  # ranks splitting one sequence read the same samples
    problem = rules.global_batch(data.global_batch_size, data.micro_batch_size, dp, p)
    report.error(problem)
    if not problem and vpp and vpp > 1:
        micro_batches = data.global_batch_size // (data.micro_batch_size * dp)
        report.error(rules.interleaved_micro_batches(micro_batches, pp, p))


def expert_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig,
                 moe: MoEConfig | None) -> None:
    world = trainer.num_nodes * trainer.devices
    if world % (parallel.tp * parallel.pp) == 0:  # otherwise the layout rules said so already
        report.error(rules.expert_layout(moe.num_experts if moe is not None else None, parallel.ep,
                                         world // (parallel.tp * parallel.pp), p))
    if moe is not None and (problem := rules.dropless_on_xla(moe.capacity_factor, trainer.accelerator, p)):
        report.warn(problem)


def context_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig, shape: dict) -> None:
    cp, ulysses, tp = parallel.cp, parallel.ulysses, parallel.tp
    world = trainer.num_nodes * trainer.devices
    if world % (tp * parallel.pp) == 0:  # otherwise the layout rules said so already
        report.error(rules.context_layout(cp, ulysses, world // (tp * parallel.pp), p))
    if shape.get("encoder_seq_length"):
        report.error(rules.context_sequence(shape["encoder_seq_length"], cp, ulysses, tp, parallel.sequence_parallel,
                                            p))
    if "num_attention_heads" in shape:
        report.error(rules.ulysses_heads(shape["num_attention_heads"], tp, ulysses, p))
    moe = shape.get("moe")
    report.error(rules.context_architecture(moe.num_experts if moe is not None else None,
                                            shape.get("attention_dropout", 0.0) or 0.0, cp, ulysses, p))
    report.error(rules.context_window(shape.get("layer_types"), cp, ulysses, p))


def elastic_rules(report: Report, p: str, trainer: TrainerConfig, parallel: ParallelConfig, data: DataConfig | None,
                  shape: dict) -> None:
    """run.elastic: the layout rules above (the world against tp x pp, the global batch, the context and expert
    groups) run again for trainer.num_nodes - 1 nodes, where they hold for num_nodes (else they have said so)."""
    def first_problem(num_nodes: int) -> str | None:
        scratch = Report()
        world = dataclasses.replace(trainer, num_nodes=num_nodes)
        layout_rules(scratch, p, world, parallel, data)
        expert_rules(scratch, p, world, parallel, shape.get("moe"))
        context_rules(scratch, p, world, parallel, shape)
        return scratch.errors[0] if scratch.errors else None

    if trainer.num_nodes < 2:
        report.error(rules.elastic_nodes(trainer.num_nodes, None, p))
    elif first_problem(trainer.num_nodes) is None:
        report.error(rules.elastic_nodes(trainer.num_nodes, first_problem(trainer.num_nodes - 1), p))
