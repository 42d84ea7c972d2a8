"""The layout rules: how the world splits into tp x pp model replicas and data parallelism, the global batch
into micro-batches, the layers into pipeline stages (stage_layers, the one owner of that split), and the sequence
over a context group (ring attention or Ulysses). Rules as runtime/schema/rules.py describes them; callers use
them as rules.<name>."""
from __future__ import annotations


# ------------------------------------------------------------------------------------------------------ layout
def world_divisible(world: int, world_text: str, tp: int, pp: int, p: str) -> str | None:
    """The world must split into whole tp x pp model replicas; what is left is data parallelism."""
    if world % (tp * pp) == 0:
        return None
    return (f"{p}trainer: {world_text} is not divisible by tensor_model_parallel_size × "
            f"pipeline_model_parallel_size = {tp} × {pp} = {tp * pp}; change the node count or the parallel sizes")


def world_text(num_nodes: int, devices: int) -> str:
    return f"num_nodes × devices = {num_nodes} × {devices} = {num_nodes * devices}"


def elastic_nodes(num_nodes: int, smaller: str | None, p: str) -> str | None:
    """run.elastic: a job that loses a node and has no spare goes on with the nodes left, with fewer data-parallel
    replicas over the same global batch. It needs a node to lose, and its layout must hold one node smaller too:
    `smaller` is the first layout rule's line for num_nodes - 1 nodes (None: they all hold)."""
    if num_nodes < 2:
        return (f"{p}run.elastic: true needs trainer.num_nodes >= 2 (it is {num_nodes}): a one-node job has no node "
                f"to go on without; set {p}run.elastic=false or train on more nodes")
    if smaller is None:
        return None
    return (f"{p}run.elastic: true, but the layout breaks one node smaller (trainer.num_nodes - 1 = {num_nodes - 1} "
            f"nodes, after a lost node): {smaller}; or set {p}run.elastic=false")


ZERO_STAGES = (0, 1, 2, 3)


def zero_stage(stage: int | None, zero1: bool | None, p: str) -> str | None:
    """model.zero_stage (Megatron-DeepSpeed's ZERO_STAGE): 0 plain data parallelism, 1 the optimizer state sharded
    (what model.zero1: true means), 2 the gradients too, 3 the parameters too (FSDP: gathered per block,
    runtime/parallel/zero3.py). A stage raises what zero1: false (the recipes' default) says; zero1: true with
    stage 0 asks for two things."""
    if stage is None:
        return None
    if stage not in ZERO_STAGES:
        return f"{p}model.zero_stage: {stage} is not a ZeRO stage; use 0, 1, 2 or 3"
    if zero1 and stage == 0:
        return (f"{p}model.zero1: {str(zero1).lower()} contradicts model.zero_stage {stage} (zero1: true is stage 1 "
                f"and stages 2 and 3 shard the optimizer state too); drop model.zero1 or make them agree")
    return None


def zero3_on_xla(stage: int, accelerator: str, p: str) -> str | None:
    """ZeRO-3 frees each bucket's parameter storage between uses by resizing it (runtime/parallel/zero3.py); XLA
    tensors (Neuron's torch-xla) have no storage to resize."""
    if stage == 3 and accelerator == "neuron":
        return (f"{p}model.zero_stage: 3 frees parameter storage between uses, which XLA devices (trainer.accelerator "
                f"neuron) cannot; use model.zero_stage 1 or 2")
    return None


def shard_degree(degree: int | None, stage: int, dp: int, edp: int, p: str) -> str | None:
    """model.data_parallel_shard_degree (torchtitan's name; hybrid sharding, runtime/parallel/topology.py): ZeRO
    shards within groups of that many consecutive data-parallel ranks (a node's, when it is the devices per node)
    and replicates across them; experts likewise within their expert-data-parallel group. null: all of dp."""
    key = f"{p}model.data_parallel_shard_degree"
    if degree is None:
        return None
    if degree < 1:
        return f"{key}: {degree} must be >= 1 (or null: shard over all {dp} data-parallel ranks)"
    if stage < 1:
        return (f"{key}: {degree} shards the optimizer state, gradients or parameters, which model.zero_stage 0 "
                f"does not; set model.zero_stage to 1, 2 or 3, or {key}=null")
    if dp % degree:
        return (f"{key}: {degree} does not divide the {dp} data-parallel ranks; use a divisor of {dp} (the devices "
                f"per node keep each shard group inside a node)")
    if edp % degree:
        return (f"{key}: {degree} does not divide the {edp} expert-data-parallel ranks (data-parallel {dp} / "
                f"expert_model_parallel_size {dp // edp}); use a divisor of {edp}")
    return None


def tp_within_node(tp: int, devices: int, p: str) -> str | None:
    """Tensor-parallel groups are consecutive ranks (runtime/parallel/dims.py) and talk inside every layer: a
    group must not cross a node."""
    if devices % tp == 0:
        return None
    return (f"{p}model.tensor_model_parallel_size: {tp} must divide trainer.devices {devices} so every "
            f"tensor-parallel group stays inside one node; use a divisor of {devices}")


def global_batch(gbs: int, mbs: int, dp: int, p: str) -> str | None:
    if gbs % (mbs * dp) == 0:
        return None
    return (f"{p}model.global_batch_size: {gbs} is not divisible by micro_batch_size × data-parallel size = "
            f"{mbs} × {dp} = {mbs * dp}; use a multiple of {mbs * dp}")


def interleaved_micro_batches(micro_batches: int, pp: int, p: str) -> str | None:
    if micro_batches % pp == 0:
        return None
    return (f"{p}model.virtual_pipeline_model_parallel_size: the interleaved schedule needs the micro-batch count "
            f"({micro_batches}) to be a multiple of pipeline_model_parallel_size ({pp}); raise global_batch_size "
            f"or set virtual_pipeline_model_parallel_size=null")


def virtual_needs_pipeline(vpp: int | None, pp: int, p: str) -> str | None:
    if vpp is None or vpp == 1 or pp > 1:
        return None
    return (f"{p}model.virtual_pipeline_model_parallel_size: {vpp} needs pipeline_model_parallel_size > 1; "
            f"set it to null")


def layers_split(layers: int, pp: int, vpp: int | None, p: str, cuts: tuple[int, ...] | None = None) -> str | None:
    """Layers over pipeline_model_parallel_size x virtual stages: where model.pipeline_cuts says (NxD Training's
    key: the last layer of every stage but the last, so uneven stages balance the embedding and the head), else as
    evenly as they go (NxD Training's default too: Llama 3.1 405B's 126 layers over pp 32), each stage at least one."""
    chunks = pp * (vpp or 1)
    if cuts is not None:
        bounds = [-1, *cuts, layers - 1]
        if len(cuts) == chunks - 1 and all(b > a for a, b in zip(bounds, bounds[1:])):
            return None
        return (f"{p}model.pipeline_cuts: {list(cuts)} must be {chunks - 1} increasing layer indices below "
                f"{layers - 1} (the last layer of each of the {chunks} stages but the last: pipeline_model_parallel_"
                f"size x virtual_pipeline_model_parallel_size = {pp} x {vpp or 1}), e.g. "
                f"{[round(layers * (i + 1) / chunks) - 1 for i in range(chunks - 1)]}")
    if layers >= chunks:
        return None
    return (f"{p}model.num_layers: {layers} is fewer than the pipeline stages, pipeline_model_parallel_size × "
            f"virtual_pipeline_model_parallel_size = {pp} × {vpp or 1} = {chunks}; every stage needs a layer")


def stage_layers(layers: int, stages: int, cuts: tuple[int, ...] | None = None) -> list[range]:
    """Layer index ranges of `stages` global pipeline stages, in stage order (the one owner of the split: the
    runtime builds its stages by it, the estimator counts them by it). cuts: model.pipeline_cuts, checked by
    layers_split; without them the extra layers of an uneven split go to the earliest stages (the last stage
    already carries the output head and the loss)."""
    if cuts is not None:
        bounds = [-1, *cuts, layers - 1]
        return [range(a + 1, b + 1) for a, b in zip(bounds, bounds[1:])]
    base, extra = divmod(layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


# ----------------------------------------------------------------------------------------------- long context
CONTEXT_KEYS = {"ring": "context_parallel_size", "ulysses": "ulysses_parallel_size"}


def context_kind(cp: int, ulysses: int) -> str | None:
    """Which way the sequence is split over the context group: 'ring' (context parallelism), 'ulysses', or None."""
    return "ring" if cp > 1 else "ulysses" if ulysses > 1 else None


def context_layout(cp: int, ulysses: int, dp: int, p: str) -> str | None:
    """The context group (the ranks that split one sequence) is carved out of data parallelism, as Megatron's
    context parallelism is: its size must divide the data-parallel size. One kind of split at a time."""
    if cp > 1 and ulysses > 1:
        return (f"{p}model.ulysses_parallel_size: {ulysses} together with context_parallel_size {cp}; split the "
                f"sequence one way: set one of them to 1")
    size, key = max(cp, ulysses), CONTEXT_KEYS[context_kind(cp, ulysses) or "ring"]
    if size >= 1 and dp % size == 0:
        return None
    return (f"{p}model.{key}: {size} must divide the data-parallel size {dp} (world / (tensor_model_parallel_size "
            f"x pipeline_model_parallel_size)), out of which the context group is carved; use a divisor of {dp}")


def context_sequence(seq: int, cp: int, ulysses: int, tp: int, sequence_parallel: bool, p: str) -> str | None:
    """Ring attention balances causal work by giving rank r the sequence chunks r and 2·cp−1−r, so the sequence
    splits into 2·cp equal chunks; Ulysses splits it into `ulysses` contiguous ones. Sequence parallelism then
    splits each rank's tokens over tensor parallelism."""
    kind = context_kind(cp, ulysses)
    if kind is None:
        return None
    parts = 2 * cp if kind == "ring" else ulysses
    key, size = CONTEXT_KEYS[kind], max(cp, ulysses)
    if seq % parts:
        why = f"2 × {key} = {parts} (each rank holds two chunks, for causal load balance)" if kind == "ring" else \
            f"{key} = {parts}"
        return f"{p}model.encoder_seq_length: {seq} is not divisible by {why}; use a multiple of {parts}"
    if sequence_parallel and tp > 1 and (seq // size) % tp:
        return (f"{p}model.encoder_seq_length: {seq} / {key} {size} = {seq // size} tokens per rank do not split "
                f"over tensor_model_parallel_size {tp} for sequence parallelism; use a multiple of {size * tp}")
    return None


def ulysses_heads(heads: int, tp: int, ulysses: int, p: str) -> str | None:
    """Ulysses trades the sequence split for a head split around attention: each rank's heads (after tensor
    parallelism) must divide evenly. KV heads that do not divide are replicated, so only the query heads count."""
    if ulysses <= 1 or heads % tp or (heads // tp) % ulysses == 0:
        return None
    return (f"{p}model.ulysses_parallel_size: {ulysses} must divide the attention heads per tensor-parallel rank "
            f"(num_attention_heads {heads} / tensor_model_parallel_size {tp} = {heads // tp}); use a divisor of "
            f"{heads // tp}, or context_parallel_size")


def context_architecture(num_experts: int | None, attention_dropout: float, cp: int, ulysses: int,
                         p: str) -> str | None:
    """What cannot split its sequence exactly. MoE: routing capacity and the load-balancing loss are functions of
    the whole micro-batch's tokens, so a rank routing only its share would drop and balance differently. Ring
    attention: it merges partial softmaxes, with no place for attention dropout's mask."""
    kind = context_kind(cp, ulysses)
    if kind is None:
        return None
    key, size = CONTEXT_KEYS[kind], max(cp, ulysses)
    if num_experts:
        return (f"{p}model.{key}: {size} with MoE layers (model.moe.num_experts {num_experts}): routing and its "
                f"losses need each micro-batch's whole sequence; set {key}=1 and use expert_model_parallel_size")
    if kind == "ring" and attention_dropout:
        return (f"{p}model.attention_dropout: {attention_dropout} with context_parallel_size {cp}: ring attention "
                f"has no attention dropout; set attention_dropout=0.0 (or use ulysses_parallel_size)")
    return None
