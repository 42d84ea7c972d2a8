# Apply parallelism to a plain model from runtime/models, in place and in a fixed order (torchtitan style):
# tensor parallelism (+ sequence parallelism), expert parallelism (MoE blocks), context parallelism (ring or
# Ulysses attention), activation checkpointing, the pipeline split, materializing this rank's part (a model built
# on the meta device), the move to the device, then data parallelism (flat buffers, gradient reduction, ZeRO-1
# ownership). The result carries its ShardingPlan (`model.sharding_plan`), the one record of where every
# parameter's values live.
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.models.init import materialize
from runtime.models.layers import Attention, Block, GeluMLP, SwiGLU
from runtime.models.moe import SparseMoE
from runtime.schema import rules
from runtime.schema.choices import CHECKPOINT_GRANULARITIES, RECOMPUTE_MODULES
from runtime.schema.rules import context_window
from runtime.models.transformer import CausalLM
from runtime.parallel import collectives as C
from runtime.parallel import layers as L
from runtime.parallel.context import apply_context_parallel
from runtime.parallel.data_parallel import DataParallelConfig, apply_data_parallel
from runtime.parallel.experts import apply_expert_parallel
from runtime.parallel.plan import ShardingPlan
from runtime.parallel.topology import AxisGroup, Topology


def parallelize_model(model: CausalLM, topo: Topology, *, sequence_parallel: bool = False,
                      activation_checkpointing: str | None = None,
                      recompute_modules: Sequence[str] = ("core_attention",),
                      virtual_pp: int | None = None, pipeline_cuts: Sequence[int] | None = None,
                      device: torch.device | str | None = None,
                      data_parallel: DataParallelConfig | None = None, context: str = "ring",
                      attention_kernels=None,
                      starting_weights: Callable[[nn.Module, ShardingPlan], None] | None = None,
                      shapes_only: bool = False) -> nn.Module:
    """Shard `model` for this rank's place in `topo`; returns it, with its ShardingPlan as `sharding_plan`.

    `model` is either on the meta device (meta_model, maybe with LoRA adapters): then only shapes are sharded,
    and this rank's parameters are materialized last, on the host, from the model's init rules
    (runtime/models/init.py), so nothing but the rank's own part ever exists here; or built (build_model): then
    its values are sliced. Either way a layout starts from exactly the values of one process.

    sequence_parallel: Megatron's sequence parallelism (only meaningful with tp > 1).
    activation_checkpointing: None, 'full' (recompute every transformer layer) or 'selective' (recompute the
    `recompute_modules` of every layer: 'core_attention' and/or 'mlp'; empty means ['core_attention']).
    With pp > 1 the result is this rank's PipelineStageModel (runtime/parallel/pipeline), holding `virtual_pp`
    model chunks (None or 1: one), run by train_step/eval_step through a pipeline schedule; pipeline_cuts: the
    last layer of each stage but the last (None: as even as the layers allow; pipeline/stages.py split_layers).
    device: move the parallelized model there (and re-tie a shared embedding the move may have untied).
    data_parallel: apply data parallelism last (runtime/parallel/data_parallel.py); the optimizer needs it.
    context: how attention crosses a context group of more than one rank (topo.cp): 'ring' or 'ulysses'.
    attention_kernels: runtime.device.flash_attention_kernels for ring attention's blocks (None: spelled-out math).
    starting_weights(model, plan): fills the materialized parameters with pretrained values, each from its own
    selection (runtime/finetune.py), before the move to the device and data parallelism's copies.
    shapes_only: return a meta model's shard still on the meta device (what the rank would hold, allocated by
    nothing: sizes at any scale); device and data_parallel must then be None.
    """
    recompute_modules = _check_parallelize(model, topo, activation_checkpointing, recompute_modules, context)
    seed = model.cfg.seed
    rules = model.init_rules() if any(p.is_meta for p in model.parameters()) else None  # read unsharded
    plan = ShardingPlan(topo.tp.size)
    if topo.tp.size > 1:
        plan = apply_tensor_parallel(model, topo.tp, sequence_parallel=sequence_parallel)
    if any(isinstance(m, SparseMoE) for m in model.modules()) and (topo.ep.size > 1 or topo.tp.size > 1):
        apply_expert_parallel(model, topo, plan, sequence_parallel=sequence_parallel)
    if topo.cp.size > 1:
        apply_context_parallel(model, topo.cp, context, attention_kernels)
    if activation_checkpointing == "full":
        for block in model.layers:
            checkpoint_module(block)
    elif activation_checkpointing == "selective":
        for block in model.layers:
            for name in recompute_modules or ("core_attention",):
                checkpoint_module(block.attn.core_attention if name == "core_attention" else block.mlp)
    if topo.pp.size > 1:
        from runtime.parallel.pipeline.stages import split_into_stages  # deferred: an import cycle via runtime.parallel
        model = split_into_stages(model, topo, plan, virtual_pp=virtual_pp, sequence_parallel=sequence_parallel,
                                  cuts=pipeline_cuts)
        plan.keep_only(name for name, _ in model.named_parameters(remove_duplicate=False))
    model.sharding_plan = plan
    if shapes_only:
        assert device is None and data_parallel is None, "a shapes-only shard is not moved or data-parallelized"
        return model
    if rules is not None:
        materialize(model, rules, seed, plan.where)
    if starting_weights is not None:
        starting_weights(model, plan)
    if device is not None:
        model = model.to(device)
        # Moving to an XLA device makes new Parameters module by module, silently untying a shared embedding.
        model.tie_weights()
    if data_parallel is not None:
        apply_data_parallel(model, topo, data_parallel)
    return model


def _check_parallelize(model: CausalLM, topo: Topology, activation_checkpointing: str | None,
                       recompute_modules: Sequence[str], context: str) -> list[str]:
    """The ValueErrors parallelize_model's arguments can raise, before anything is changed; returns the
    recompute_modules by their canonical names."""
    problems = [CHECKPOINT_GRANULARITIES.problem("training.model.activations_checkpoint_granularity",
                                                 activation_checkpointing)]
    problems += [RECOMPUTE_MODULES.problem("training.model.activations_checkpoint_recompute", name)
                 for name in recompute_modules]
    sizes = (topo.cp.size, 1) if context == "ring" else (1, topo.cp.size)
    problems.append(context_window(model.cfg.layer_types, *sizes, "training."))  # no window in cp's attentions
    if any(problems):
        raise ValueError(next(p for p in problems if p))
    canonical = [RECOMPUTE_MODULES.canonical(name) for name in recompute_modules]
    if topo.cp.size > 1 and any(isinstance(m, Attention) and m.sinks is not None for m in model.modules()):
        raise ValueError(f"training.model.context_parallel_size: {topo.cp.size} with attention sinks "
                         f"(model.architecture={model.cfg.architecture}): ring and Ulysses attention have no sink "
                         "column; set context_parallel_size=1")
    # A family's module that context parallelism's attentions do not cover names itself (its `no_context_parallel`).
    unbuilt = next((m.no_context_parallel for m in model.modules() if getattr(m, "no_context_parallel", None)), None)
    if topo.cp.size > 1 and unbuilt:
        key = "context_parallel_size" if context == "ring" else "ulysses_parallel_size"
        raise ValueError(f"training.model.{key}: {topo.cp.size} with {unbuilt} (model.architecture="
                         f"{model.cfg.architecture}): not built under context parallelism; set {key}=1")
    return canonical


def check_tensor_parallel(cfg, tp: int) -> None:
    """The ValueErrors a user can hit for a given tensor_model_parallel_size (also usable before building)."""
    p = "training."
    problems = [rules.heads_tp(cfg.num_attention_heads, tp, p), rules.ffn_tp(cfg.ffn_hidden_size, tp, p),
                rules.vocab_tp(cfg.vocab_size, 1, tp, p), rules.kv_heads_tp(cfg.kv_heads, tp, p)]
    if cfg.moe is not None and cfg.moe.ffn_hidden_size:
        problems.append(rules.ffn_tp(cfg.moe.ffn_hidden_size, tp, p, "moe.ffn_hidden_size"))
    if any(problems):
        raise ValueError(next(problem for problem in problems if problem))


def apply_tensor_parallel(model: CausalLM, axis: AxisGroup, *, sequence_parallel: bool) -> ShardingPlan:
    """Megatron layout: QKV and MLP-in column-parallel, attention-out and MLP-out row-parallel, embedding and
    output head split by vocabulary, loss vocab-parallel. Sequence parallelism keeps the norm/dropout/residual
    regions split along the sequence between a block's row-parallel output and the next column-parallel input.
    Returns the plan of what it sharded."""
    cfg = model.cfg
    check_tensor_parallel(cfg, axis.size)
    sp = sequence_parallel

    model.embed.word = L.VocabParallelEmbedding(model.embed.word, axis)
    if sp:
        # Positions and dropout act on the full replicated sequence; the blocks then see only this rank's shard.
        model.embed.register_forward_hook(lambda _module, _args, out: C.scatter_to_sequence(out, axis))

    rows = {path: [size for _, size in parts] for path, parts in cfg.fused_segments().items()}
    for block in model.layers:
        _parallelize_block(block, axis, sp, rows)

    if hasattr(model.output, "parallelize"):  # a head of its own (a reward model's score) places itself
        model.output.parallelize(axis, sp)
    else:
        if cfg.share_embeddings_and_output_weights:
            # Same vocabulary rows as the embedding shard, so the tied weight stays one parameter.
            model.output = L.ColumnParallelLinear(model.embed.word.weight, None, axis, sp,
                                                  {"weight": model.embed.word.placements["weight"]})
        else:
            model.output = L.ColumnParallelLinear.from_linear(model.output, axis, sequence_parallel=sp)
        model.loss_fn = L.VocabParallelCrossEntropy(axis, cfg.padding_from)
        model.gather_vocab = L.GatherFromRegion(axis)
    plan = ShardingPlan.collect(model, axis.size)
    for i, block in enumerate(model.layers):
        # Per-head query/key norms: one weight for all heads, each rank applying it to its own heads only (the
        # replicas of a shared KV head to the queries of their rank), so each rank's gradient is a part.
        if getattr(block.attn, "q_norm", None) is not None:
            for norm in ("q_norm", "k_norm"):
                plan.mark(f"layers.{i}.attn.{norm}.weight", partial_grad=True)
        # An attention of its own names the replicated weights whose gradient each rank computes only a part of.
        for name in getattr(block.attn, "partial_grads", ()):
            plan.mark(f"layers.{i}.attn.{name}", partial_grad=True)
    if sp:
        # Replicated norm weights applied to a sequence shard: each rank's gradient covers only its tokens.
        norms = [f"layers.{i}.{name}" for i, block in enumerate(model.layers) for name, _ in block.named_children()
                 if name.endswith("norm")]  # attn_norm, mlp_norm, and a sandwich's attn_out_norm, mlp_out_norm
        for prefix in norms + ["final_norm"]:
            for name, _ in model.get_submodule(prefix).named_parameters(prefix=prefix):
                plan.mark(name, partial_grad=True)
    return plan


def _parallelize_block(block: Block, axis: AxisGroup, sp: bool, fused: dict[str, list[int]]) -> None:
    """`fused`: the fused projections' parts' row counts (ModelConfig.fused_segments), each split over the ranks.
    An attention of a family's own (its `parallelize(axis, sequence_parallel)`) splits itself."""
    if hasattr(block.attn, "parallelize"):
        block.attn.parallelize(axis, sp)
    else:
        _parallelize_attention(block.attn, axis, sp, fused)
    _parallelize_mlp(block.mlp, axis, sp, fused)


def _parallelize_attention(attn: Attention, axis: AxisGroup, sp: bool, fused: dict[str, list[int]]) -> None:
    t = axis.size
    nh, ng, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if ng % t == 0:
        rows = L.shard_rows(fused["attn.qkv"], axis.rank, t)  # rank keeps [q_r | k_r | v_r]
        attn.qkv = L.ColumnParallelLinear.from_linear(attn.qkv, axis, sequence_parallel=sp, rows=rows)
    else:
        attn.qkv = L.ReplicatedKVColumnParallelLinear(attn.qkv, axis, sequence_parallel=sp, num_heads=nh,
                                                      num_kv_heads=ng, head_dim=d)
    attn.proj = L.RowParallelLinear(attn.proj, axis, sequence_parallel=sp)
    attn.num_heads, attn.num_kv_heads = nh // t, max(ng // t, 1)
    if attn.sinks is not None:  # one logit per query head: the rank keeps its heads' (contiguous, as q's rows)
        attn.sinks, sinks = L._param_from(attn.sinks, L.shard_rows([nh], axis.rank, t), 0)
        attn.placements = {"sinks": sinks}


def _parallelize_mlp(mlp: nn.Module, axis: AxisGroup, sp: bool, fused: dict[str, list[int]]) -> None:
    t = axis.size
    if isinstance(mlp, GeluMLP):
        mlp.fc1 = L.ColumnParallelLinear.from_linear(mlp.fc1, axis, sequence_parallel=sp)
        mlp.fc2 = L.RowParallelLinear(mlp.fc2, axis, sequence_parallel=sp)
    elif isinstance(mlp, SparseMoE):
        pass  # its experts are split by apply_expert_parallel; the router stays whole on every rank
    elif isinstance(mlp, SwiGLU):
        rows = L.shard_rows(fused["mlp.gate_up"], axis.rank, t)  # rank keeps [gate_r | up_r]
        mlp.gate_up = L.ColumnParallelLinear.from_linear(mlp.gate_up, axis, sequence_parallel=sp, rows=rows)
        mlp.down = L.RowParallelLinear(mlp.down, axis, sequence_parallel=sp)
    else:
        raise AssertionError(f"no tensor-parallel plan for {type(mlp).__name__}")


def checkpoint_module(module: nn.Module) -> None:
    """Recompute `module`'s forward during backward instead of keeping its activations.

    Patches the instance's forward rather than wrapping the module, so parameter names (and therefore
    checkpoints) are the same with and without activation checkpointing.
    """
    inner = module.forward

    def forward(*args, **kwargs):
        # Non-reentrant: works with inputs that do not require grad and keeps RNG state for dropout replay.
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
