# The layout grid of an autoconfig search: every combination of tensor, pipeline, virtual pipeline and context
# parallel sizes, micro-batch size, activation checkpointing, ZeRO stage and shard group (hybrid sharding), kept
# when the schema's rules accept it (runtime/schema, the same rules as at launch and on the node), the launch's
# memory check would not refuse it (device and host memory, launcher/memory_fit.py) and the memory estimate fits
# the device; ranked by the estimator's step time. Pure functions of the base training config and the search settings.
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from launcher import memory_fit, validate
from launcher.config import Cluster
from launcher.errors import UserError
from launcher.estimator import Estimate, estimate
from runtime.schema.parallel_dims import ParallelDims

RECOMPUTE = {None: (None, []), "selective": ("selective", ["core_attention"]),
             "selective_mlp": ("selective", ["core_attention", "mlp"]), "full": ("full", [])}

# From this many tokens per sample, `auto` also tries context parallelism (NeMo's long-context recipes start at 16k;
# below it a context group only adds ring traffic to what the activations need).
LONG_SEQUENCE = 16384


@dataclasses.dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    vpp: int | None
    micro_batch_size: int
    recompute: str | None        # a key of RECOMPUTE
    sequence_parallel: bool
    zero_stage: int              # model.zero_stage: 0, 1 (model.zero1), 2 (gradients sharded too), 3 (parameters too)
    cp: int = 1                  # context_parallel_size: ranks of dp that split each sequence (ring attention)
    shard_degree: int | None = None  # model.data_parallel_shard_degree (hybrid sharding); None: the recipe's

    @property
    def tag(self) -> str:
        """Short and filesystem-safe: names the candidate's run."""
        vpp = f"_vpp{self.vpp}" if self.vpp else ""
        cp = f"_cp{self.cp}" if self.cp > 1 else ""
        zero = f"_zero{self.zero_stage}" if self.zero_stage >= 2 else ""  # 0 and 1 keep the names they had
        shard = f"_shard{self.shard_degree}" if self.shard_degree else ""
        return (f"tp{self.tp}_pp{self.pp}{vpp}{cp}_mbs{self.micro_batch_size}_{self.recompute or 'norecompute'}"
                f"{zero}{shard}")

    def settings(self) -> dict[str, Any]:
        """The candidate's keys under `training.`."""
        granularity, modules = RECOMPUTE[self.recompute]
        shard = {} if self.shard_degree is None else {"model.data_parallel_shard_degree": self.shard_degree}
        return {
            "model.tensor_model_parallel_size": self.tp,
            "model.pipeline_model_parallel_size": self.pp,
            "model.virtual_pipeline_model_parallel_size": self.vpp,
            "model.context_parallel_size": self.cp,
            "model.micro_batch_size": self.micro_batch_size,
            "model.sequence_parallel": self.sequence_parallel,
            "model.zero1": self.zero_stage >= 1,  # agrees with the stage, whatever the recipe's zero1 says
            "model.zero_stage": self.zero_stage,
            "model.activations_checkpoint_granularity": granularity,
            "model.activations_checkpoint_recompute": modules,
            **shard,
        }


@dataclasses.dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    estimate: Estimate | None
    rejected: str | None = None  # why it is not launched: the layout is invalid, or the estimate does not fit

    @property
    def step_seconds(self) -> float:
        return self.estimate.step.total_s if self.estimate else float("inf")


def _powers_of_two(limit: int) -> list[int]:
    values, value = [], 1
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def axis_values(search: dict[str, Any], key: str, auto: list) -> list:
    """A search axis: a list as given, or `auto`."""
    value = search.get(key, "auto")
    if value == "auto" or value is None:
        return auto
    if not isinstance(value, list) or not value:
        raise UserError(f"search_config.search.{key}: {value!r} must be a non-empty list or auto, "
                        f"e.g. search_config.search.{key}=[1,2]")
    return value


def context_sizes(seq_length: int | None, dp: int) -> list[int]:
    """`auto` context-parallel sizes for one (tp, pp): 1, and for a long sequence the powers of two that divide the
    data-parallel size (the context group is carved out of it) and split the sequence into 2·cp equal chunks."""
    if not seq_length or seq_length < LONG_SEQUENCE:
        return [1]
    return [cp for cp in _powers_of_two(dp) if dp % cp == 0 and seq_length % (2 * cp) == 0]


def zero_stages(search: dict[str, Any], default: int) -> list[int]:
    """search.zero_stage: `auto` (the recipe's stage, `default`) or a list of stages; the older search.zero1
    (true/false: stage 1/0) is still read when zero_stage is auto."""
    stages, zero1 = search.get("zero_stage", "auto"), search.get("zero1", "auto")
    if stages in ("auto", None):
        if zero1 in ("auto", None):
            return [default]
        if not isinstance(zero1, bool):
            raise UserError(f"search_config.search.zero1: {zero1!r} must be true, false or auto; or search "
                            f"ZeRO stages with search_config.search.zero_stage=[1,2]")
        return [int(zero1)]
    if zero1 not in ("auto", None):
        raise UserError("search_config.search.zero1: set it or search_config.search.zero_stage, not both; drop "
                        "zero1 (zero_stage [0] or [1] says the same)")
    values = axis_values(search, "zero_stage", [default])
    bad = [v for v in values if isinstance(v, bool) or v not in (0, 1, 2, 3)]
    if bad:
        raise UserError(f"search_config.search.zero_stage: {bad[0]!r} is not a ZeRO stage; use a list of 0, 1, 2 "
                        f"and 3, e.g. search_config.search.zero_stage=[1,2,3]")
    return [int(v) for v in values]


def shard_degrees(search: dict[str, Any]) -> list[int | None]:
    """search.data_parallel_shard_degree: `auto` (the recipe's own) or a list of shard group sizes, null meaning
    all of dp. A size that does not divide a layout's dp is left to the schema's rules, which reject that layout."""
    values = axis_values(search, "data_parallel_shard_degree", [None])
    bad = [v for v in values if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1)]
    if bad:
        raise UserError(f"search_config.search.data_parallel_shard_degree: {bad[0]!r} is not a shard group size; "
                        f"use a list of positive integers or null (all of dp), e.g. "
                        f"search_config.search.data_parallel_shard_degree=[null,8]")
    return values


def grid(search: dict[str, Any], *, nodes: int, devices_per_node: int, num_layers: int,
         zero_stage_default: int, seq_length: int | None = None) -> list[Candidate]:
    """Every combination the search names. `auto`: tp in powers of two up to the devices per node, pp up to
    the layers (and the world), micro-batch 1..8, no virtual pipeline, each recompute mode, and context parallelism
    only for a sequence of LONG_SEQUENCE tokens or more (see context_sizes), and the recipe's ZeRO stage
    (zero_stage_default; see zero_stages) with the recipe's shard group (a given list of shard degrees is tried
    with every stage from 1, stage 0 shards nothing). A given list of context sizes is tried
    with every (tp, pp), and the schema's rules reject the sizes that do not divide that data-parallel size."""
    world = nodes * devices_per_node
    tps = axis_values(search, "tensor_parallel_sizes", _powers_of_two(devices_per_node))
    pps = axis_values(search, "pipeline_parallel_sizes", [p for p in _powers_of_two(min(world, num_layers))])
    vpps = axis_values(search, "virtual_pipeline_sizes", [None])
    mbss = axis_values(search, "micro_batch_sizes", [1, 2, 4, 8])
    recomputes = axis_values(search, "activations_checkpoint", [None, "selective", "full"])
    cps = search.get("context_parallel_sizes", "auto")
    if cps not in ("auto", None):
        cps = axis_values(search, "context_parallel_sizes", [1])
    for mode in recomputes:
        if mode not in RECOMPUTE:
            raise UserError(f"search_config.search.activations_checkpoint: {mode!r} is not one of "
                            f"{', '.join('null' if m is None else m for m in RECOMPUTE)}")
    sequence_parallel = search.get("sequence_parallel", "auto")
    stages = zero_stages(search, zero_stage_default)
    shards = shard_degrees(search)

    def contexts(tp: int, pp: int) -> list[int]:
        if isinstance(cps, list):
            return [int(cp) for cp in cps]
        try:  # the runtime's rank arithmetic: data parallelism is what tp and pp leave of the world
            dp = ParallelDims.infer_dp(int(tp), int(pp), world).dp
        except ValueError:
            dp = 1  # the schema's rules reject the layout, whatever its context size
        return context_sizes(seq_length, dp)

    return [
        Candidate(tp=int(tp), pp=int(pp), vpp=int(vpp) if vpp else None, micro_batch_size=int(mbs), recompute=mode,
                  sequence_parallel=tp > 1 if sequence_parallel == "auto" else bool(sequence_parallel) and tp > 1,
                  zero_stage=stage, cp=cp, shard_degree=shard)
        for tp in tps for pp in pps for cp in contexts(tp, pp) for vpp in vpps for mbs in mbss for mode in recomputes
        for stage in stages for shard in (shards if stage >= 1 else [None])
    ]


def apply(training: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """A copy of a resolved training config with dotted `settings` set."""
    result = copy.deepcopy(training)
    for dotted, value in settings.items():
        node = result
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return result


def rank(base: dict[str, Any], candidates: list[Candidate], *, device: str | None, mfu: float | None,
         vocab_size: int | None, cluster: Cluster, local: bool) -> list[Ranked]:
    """Launchable candidates first, fastest estimated step first; then the rejected ones with their reason: the
    schema's rules reject the layout, the launch would refuse it for memory (memory_fit.stage_memory_fit, the launch's
    own rule, on `cluster`'s nodes, or this machine where the local executor runs it: `local`), or its estimate on
    `device` does not fit the device with the activations (stricter than the launch, which only warns there)."""
    ranked = []
    for candidate in candidates:
        training = apply(base, candidate.settings())
        errors = validate.training(training, vocab_size=vocab_size)
        if errors:
            ranked.append(Ranked(candidate, None, "invalid: " + errors[0]))
            continue
        result = estimate(training, device=device, mfu=mfu, vocab_size=vocab_size,
                          neuron_hardware=cluster.neuron_hardware, node_memory_bytes=cluster.node_memory_bytes)
        refusals, _ = memory_fit.stage_memory_fit(training, "training", cluster, local=local, vocab_size=vocab_size)
        if refusals:
            # The line's figures; its fixes (other parallel sizes) are what the search tries anyway.
            ranked.append(Ranked(candidate, result, "refused at launch: " + refusals[0].split("; ")[0]))
        elif not result.fits:
            ranked.append(Ranked(candidate, result, f"estimated {result.memory.total / 2**30:.1f} GiB > "
                                                    f"{result.hardware.usable_bytes / 2**30:.1f} GiB usable"))
        else:
            ranked.append(Ranked(candidate, result))
    # Ties (equal estimates) go to the layout with fewer ranks per sample (tp x pp x cp), then the larger micro-batch.
    return sorted(ranked, key=lambda r: (r.rejected is not None, r.step_seconds,
                                         r.candidate.tp * r.candidate.pp * r.candidate.cp,
                                         -r.candidate.micro_batch_size))
