# The model shape and the parallel layout the estimator works from, as the schema reads a resolved training config
# (runtime/schema/training.py parse_sizing and model_shape_keys: one reader of the Seam 2 keys), and the parameter
# count of the runtime's models (runtime/models) as pure arithmetic.
#
# MoE (model.moe, runtime/models/moe.py SparseMoE): the SwiGLU MLP of every moe.frequency-th layer (or of those
# moe.layers lists) becomes num_experts SwiGLU experts of f hidden units each (gate_up (E, h, 2f), down (E, f, h))
# and a router (E, h), no biases. f is moe.ffn_hidden_size (Qwen3-MoE's 768, against a dense 6144), or
# model.ffn_hidden_size when that is null (Mixtral): ModelShape.expert_ffn_hidden_size. Dense layers keep
# model.ffn_hidden_size. The total count holds every expert; the active count, what one token's forward uses, only
# its top_k experts. On a device (runtime/parallel/experts.py): E / ep experts (expert parallelism, carved out of
# data parallelism), each split over tensor parallelism like a dense SwiGLU
# (gate_up (E/ep, h, 2f/tp), down (E/ep, f/tp, h)); the router is replicated.
#
# Long context (runtime/schema/rules_layout.py "long context"): a context group of cp ranks (ring attention) or u ranks
# (DeepSpeed-Ulysses) splits each sequence. Like expert parallelism it is carved out of data parallelism: dp still
# counts every replica (gradients and ZeRO-1 go over all of them), while only dp / context ranks read distinct
# samples; each rank holds seq / context tokens of each of its samples.
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from launcher.errors import UserError
from runtime.schema import rules
from runtime.schema.families import TOKENIZER_VOCABULARIES, architecture
from runtime.schema.model import LatentAttention, MoEConfig, tokenizer_vocab_size
from runtime.schema.reader import Report, Section
from runtime.schema.sizes import (ModelShape, attention, expert_parameters, kv_heads_per_rank,  # noqa: F401
                                  moe_block_parameters)
from runtime.schema.training import parse_latent_attention, parse_moe  # the one reader of model.moe (dropless)
from runtime.schema.training import model_shape_keys, parse_sizing
from runtime.schema.parallel_dims import ParallelDims
from runtime.schema.training_config import ParallelConfig, SizingConfig, TrainerConfig
from runtime.schema.rules import padded_vocab_size as padded_vocab  # noqa: F401 (the estimator's name for it)


@dataclasses.dataclass(frozen=True)
class Layout:
    num_nodes: int
    devices_per_node: int
    tp: int
    pp: int
    vpp: int                     # virtual pipeline chunks per pipeline rank (1 = not interleaved)
    micro_batch_size: int
    global_batch_size: int
    sequence_parallel: bool
    zero1: bool
    recompute: str | None        # None | full | selective
    recompute_modules: tuple[str, ...]
    precision: str
    ep: int = 1                  # expert-parallel size: experts sharded over ep consecutive data-parallel ranks
    cp: int = 1                  # context-parallel size: sequences split over cp consecutive dp ranks (ring)
    ulysses: int = 1             # Ulysses size: the same split, with head-split attention (one of cp, ulysses is 1)
    pipeline_cuts: tuple[int, ...] | None = None  # model.pipeline_cuts: each stage's last layer but the last's
    zero_stage: int | None = None  # model.zero_stage (2: gradients, 3: parameters sharded too); None: zero1 as 0/1
    shard_degree: int | None = None  # model.data_parallel_shard_degree (hybrid sharding); None: all of dp

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @functools.cached_property
    def parallel(self) -> ParallelConfig:
        """The layout as the schema types it (runtime/schema/training_config.py): what training reads."""
        return ParallelConfig(tp=self.tp, pp=self.pp, virtual_pp=self.vpp, sequence_parallel=self.sequence_parallel,
                              zero1=self.zero1, activation_checkpointing=self.recompute,
                              recompute_modules=self.recompute_modules, ep=self.ep, cp=self.cp,
                              ulysses=self.ulysses, pipeline_cuts=self.pipeline_cuts, zero_stage=self.zero_stage,
                              shard_degree=self.shard_degree)

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The rank layout as the runtime builds its process groups from it (runtime/schema/parallel_dims.py, the one
        owner of dp and the groups carved out of it): data parallelism takes what tp and pp leave of the world."""
        return ParallelDims.infer_dp(self.tp, self.pp, self.world_size, ep=self.ep, cp=self.context)

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the data-parallel ranks holding the same experts (whose expert gradients
        are reduced together, and over which ZeRO-1 shards the experts' optimizer state)."""
        return self.dims.edp

    @property
    def shard(self) -> int:
        """The ranks ZeRO shards over (stages 1 to 3): groups of model.data_parallel_shard_degree consecutive
        data-parallel ranks (hybrid sharding: replicated across the dp / shard groups), all of dp when null."""
        return max(1, min(self.shard_degree or self.dp, self.dp))

    @property
    def expert_shard(self) -> int:
        """The ranks the experts' state is sharded over: the expert-data-parallel ranks (ep apart) inside one
        shard group, edp x shard / dp of them (all of edp when the shard group is all of dp)."""
        return max(1, self.edp * self.shard // self.dp)

    @property
    def context(self) -> int:
        """The context group's size: the consecutive data-parallel ranks that split one sequence."""
        return self.parallel.context

    @property
    def batch_dp(self) -> int:
        """Data-parallel ranks that read distinct samples: the ranks of a context group share theirs."""
        return self.dims.batch_dp

    def tokens_per_sample(self, seq_length: int) -> int:
        """Tokens of each sample one rank holds outside core attention (before sequence parallelism's split)."""
        return seq_length // self.context

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step (gradient accumulation)."""
        return self.global_batch_size // (self.micro_batch_size * self.batch_dp)


def vocab_size_for(training: dict[str, Any], override: int | None = None) -> int:
    """The unpadded vocabulary: --vocab-size, else the tokenizer file, else a known tokenizer named in its path."""
    return vocab_for(parse_sizing(training)[0], override)  # only the model and tokenizer: estimate judges the rest


def vocab_for(sizing: SizingConfig, override: int | None = None) -> int:
    if override:
        return int(override)
    if sizing.model.get("model_config") is not None:
        try:  # the model's own vocabulary, as the schema sizes the embedding
            return int(model_shape_keys(sizing.model)["vocab_size"])
        except ValueError as error:
            raise UserError(f"{error}; the estimate needs the model's shape") from None
    path = sizing.tokenizer_path
    if path and Path(path).is_file():
        try:
            return tokenizer_vocab_size(path)
        except ValueError:
            pass  # unreadable here: a known tokenizer named in the path, or --vocab-size
    for key, known in TOKENIZER_VOCABULARIES.items():
        if key in path:
            return known
    raise UserError(f"training.model.tokenizer.model: {path or None!r} is not on this machine and names no known "
                    f"tokenizer ({', '.join(TOKENIZER_VOCABULARIES)}); pass --vocab-size N")


def shape_from_training(sizing: SizingConfig, vocab: int) -> ModelShape:
    try:
        model = model_shape_keys(sizing.model)  # with the keys a model_config (config.json) supplies
    except ValueError as error:
        raise UserError(f"{error}; the estimate needs the model's shape") from None
    if unknown := [key for key in ("num_layers", "hidden_size", "num_attention_heads", "encoder_seq_length")
                   if model.get(key) is None]:
        # A model whose shape its config.json gives (restore_from_path) where that file is not on this machine.
        raise UserError(f"training.model.{unknown[0]}: not set, and no config.json here supplies it; the estimate "
                        f"needs the model's shape (give the model's directory or its keys)")
    heads = int(model["num_attention_heads"])
    seq = int(model["encoder_seq_length"])
    return ModelShape(
        architecture=str(model["architecture"]),
        num_layers=int(model["num_layers"]),
        hidden_size=int(model["hidden_size"]),
        ffn_hidden_size=int(model["ffn_hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(model.get("num_query_groups") or heads),
        vocab_size=padded_vocab(vocab, int(model.get("make_vocab_size_divisible_by") or 128)),
        seq_length=seq,
        max_position_embeddings=int(model.get("max_position_embeddings") or seq),
        tied_embeddings=bool(model.get("share_embeddings_and_output_weights",
                                       architecture(model["architecture"]).tied_default)),
        hidden_dropout=float(model.get("hidden_dropout") or 0.0),
        attention_dropout=float(model.get("attention_dropout") or 0.0),
        moe=moe_from_model(model),
        kv_channels=int(model["kv_channels"]) if model.get("kv_channels") is not None else None,
        add_qkv_bias=bool(model.get("add_qkv_bias") or False),
        qk_layernorm=bool(model.get("qk_layernorm") or architecture(model["architecture"]).qk_norm),
        layer_types=tuple(model["layer_types"]) if model.get("layer_types") is not None else None,
        sliding_window=int(model["sliding_window"]) if model.get("sliding_window") is not None else None,
        latent_attention=latent_from_model(model),
    )


def moe_from_model(model: Mapping[str, Any]) -> MoEConfig | None:
    """model.moe as the runtime builds it: already typed when a model_config was merged in, else read from the YAML
    by the schema's own reader, so dropless and num_experts 0 mean here what they mean in training."""
    return _typed(model, "moe", MoEConfig, parse_moe)


def latent_from_model(model: Mapping[str, Any]) -> LatentAttention | None:
    """model.latent_attention as the runtime builds it, typed already or read by the schema's own reader."""
    return _typed(model, "latent_attention", LatentAttention, parse_latent_attention)


def _typed(model: Mapping[str, Any], key: str, kind: type, parse) -> Any:
    value = model.get(key)
    if value is None or isinstance(value, kind):
        return value
    report = Report()
    parsed = parse(Section(model, "training.model", report))
    if report.errors:
        raise UserError(*report.errors)
    return parsed


def layout_from_training(sizing: SizingConfig, trainer: TrainerConfig) -> Layout:
    """The layout of a training config, from the schema's reading of it: `sizing` read without errors (its parallel
    layout, batch and precision), `trainer` its trainer section."""
    parallel = sizing.parallel
    return Layout(
        num_nodes=trainer.num_nodes,
        devices_per_node=trainer.devices,
        tp=parallel.tp,
        pp=parallel.pp,
        vpp=parallel.virtual_pp or 1,
        micro_batch_size=sizing.micro_batch_size,
        global_batch_size=sizing.global_batch_size,
        sequence_parallel=parallel.sequence_parallel,
        zero1=parallel.zero1,
        recompute=parallel.activation_checkpointing,
        recompute_modules=parallel.recompute_modules,  # canonical: NxD Training's class names read as ours
        precision=sizing.precision.type,
        ep=parallel.ep,
        cp=parallel.cp,
        ulysses=parallel.ulysses,
        pipeline_cuts=parallel.pipeline_cuts,
        zero_stage=parallel.zero_stage,
        shard_degree=parallel.shard_degree,
    )


# ---- parameter counts ---------------------------------------------------------------------------------------

def layer_parameters(shape: ModelShape, tp: int = 1, *, moe: bool = False, ep: int = 1) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank (tp=1: the whole layer); `moe`: the
    layer with shape.moe's block in place of the MLP (the rank's num_experts / ep experts, and what it holds whole).
    Attention is runtime/schema/sizes.py's (a family's own where its registry entry names one)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if moe:
        mlp = moe_block_parameters(shape, experts=shape.moe.num_experts // ep, tp=tp)
    elif shape.gated_mlp:
        mlp = h * 2 * (f // tp) + (f // tp) * h
    else:
        mlp = h * (f // tp) + (f // tp if shape.has_bias else 0) + (f // tp) * h + (h if shape.has_bias else 0)
    norms = shape.norms_per_layer * h * (2 if shape.has_bias else 1)  # LayerNorm: weight + bias; RMSNorm: weight
    return attention(shape, tp).parameters + mlp + norms


@dataclasses.dataclass(frozen=True)
class ParameterCount:
    embedding: int               # token embedding (V x h)
    positions: int               # learned absolute positions (GPT)
    layers: int                  # all transformer layers
    final_norm: int
    output: int                  # output head; 0 when tied to the embedding
    idle_experts: int = 0        # MoE: parameters of the experts a token does not use, (E - top_k) per MoE layer

    @property
    def total(self) -> int:
        return self.embedding + self.positions + self.layers + self.final_norm + self.output

    @property
    def active(self) -> int:
        """Parameters one token's forward uses (Mixtral's "active parameters"): the total for a dense model."""
        return self.total - self.idle_experts

    @property
    def non_embedding(self) -> int:
        return self.layers + self.final_norm


def count_parameters(shape: ModelShape) -> ParameterCount:
    h, moe_layers = shape.hidden_size, shape.num_moe_layers
    layers = (shape.num_layers - moe_layers) * layer_parameters(shape, 1)
    idle = 0
    if moe_layers:
        layers += moe_layers * layer_parameters(shape, 1, moe=True)
        down_bias = h if shape.network.expert_biases else 0  # held whole, but a token uses only its experts' rows
        idle = moe_layers * (shape.moe.num_experts - shape.moe.top_k) * (expert_parameters(shape) + down_bias)
    return ParameterCount(
        embedding=shape.vocab_size * h,
        positions=shape.max_position_embeddings * h if shape.learned_positions else 0,
        layers=layers,
        final_norm=h * (2 if shape.has_bias else 1),
        output=0 if shape.tied_embeddings else shape.vocab_size * h,
        idle_experts=idle,
    )


def rank_layers(shape: ModelShape, layout: Layout, rank: int) -> list[int]:
    """The layers pipeline rank `rank` holds: global stages v * pp + rank of pp * vpp, split as the runtime splits
    them (rules.stage_layers: model.pipeline_cuts, else as evenly as the layers allow)."""
    pp, vpp = layout.pp, layout.vpp
    ranges = rules.stage_layers(shape.num_layers, pp * vpp, layout.pipeline_cuts)
    return [index for v in range(vpp) for index in ranges[v * pp + rank]]


def most_layers(shape: ModelShape, layout: Layout) -> int:
    """Layers on the pipeline rank with the most: the slowest stage, which the others wait for."""
    return max(len(rank_layers(shape, layout, rank)) for rank in range(layout.pp))


def stage_rank(layout: Layout, first: bool, rank: int | None) -> int:
    """The pipeline rank a stage figure is for: `rank` when given (a middle stage), else the first or the last."""
    return rank if rank is not None else 0 if first else layout.pp - 1


def stage_moe_layers(shape: ModelShape, layout: Layout, *, first: bool, rank: int | None = None) -> int:
    """MoE layers on the first pipeline rank (first), the last, or `rank`."""
    if shape.moe is None:
        return 0
    layers = rank_layers(shape, layout, stage_rank(layout, first, rank))
    return sum(1 for index in layers if shape.is_moe_layer(index))


def stage_expert_parameters(shape: ModelShape, layout: Layout, *, first: bool, rank: int | None = None) -> int:
    """Expert weights one device of the first (or last) pipeline stage holds: E / ep experts of each of its MoE
    layers, a tp-th of each. They are reduced and ZeRO-sharded over the expert-data-parallel group (dp / ep
    ranks), where every other parameter is over dp."""
    if shape.moe is None:
        return 0
    experts = shape.moe.num_experts // layout.ep
    return stage_moe_layers(shape, layout, first=first, rank=rank) * experts * expert_parameters(shape, layout.tp)


def stage_parameters(shape: ModelShape, layout: Layout, *, first: bool, last: bool, rank: int | None = None) -> int:
    """Parameters one device of a pipeline stage holds. Positions and norms are replicated over TP; with pipeline
    parallelism a tied output head is a separate copy on the last stage (Megatron's layout)."""
    h, t = shape.hidden_size, layout.tp
    params = layer_parameters(shape, t) * len(rank_layers(shape, layout, stage_rank(layout, first, rank)))
    moe_layers = stage_moe_layers(shape, layout, first=first, rank=rank)
    if moe_layers:  # the MLP replaced by this rank's experts (E / ep, a tp-th of each) and the router
        params += moe_layers * (layer_parameters(shape, t, moe=True, ep=layout.ep) - layer_parameters(shape, t))
    if first:
        params += shape.vocab_size // t * h
        params += shape.max_position_embeddings * h if shape.learned_positions else 0
    if last:
        params += h * (2 if shape.has_bias else 1)
        if not shape.tied_embeddings or not first:
            params += shape.vocab_size // t * h
    return params


def largest_unit_parameters(shape: ModelShape, layout: Layout, *, first: bool, last: bool,
                            rank: int | None = None) -> int:
    """Parameters of the largest unit ZeRO-3 gathers whole on one device of a pipeline stage
    (runtime/parallel/zero3.py find_units): a transformer block (an MoE block with its E / ep experts), or one of
    the modules outside the blocks, the embedding (with learned positions) on the first stage, the output head on
    the last (a tied head is the embedding's own buffer where both are on one stage). A tp-th of each, as held."""
    h, t = shape.hidden_size, layout.tp
    moe_layers = stage_moe_layers(shape, layout, first=first, rank=rank)
    layers = len(rank_layers(shape, layout, stage_rank(layout, first, rank)))
    units = [layer_parameters(shape, t)] if layers > moe_layers else []
    if moe_layers:
        units.append(layer_parameters(shape, t, moe=True, ep=layout.ep))
    if first:
        units.append(shape.vocab_size // t * h + (shape.max_position_embeddings * h if shape.learned_positions else 0))
    if last and (not shape.tied_embeddings or not first):
        units.append(shape.vocab_size // t * h)
    return max(units, default=0)
