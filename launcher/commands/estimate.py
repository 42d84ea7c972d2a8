"""`nxdt-launch estimate [OVERRIDES]`: memory per device, host memory per node and time to train for a recipe,
before launching it.

    nxdt-launch estimate training=llama3/8b
    nxdt-launch estimate training=gpt3/175b --device h200 --tokens 300e9 --mfu 0.45
    nxdt-launch estimate training=llama3/70b training.model.micro_batch_size=2

The overrides are the launch's own (Hydra syntax, composed the same way); nothing is written or submitted.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import click

from launcher.commands import FiniteFloatRange
from launcher.config import LaunchConfig
from launcher.errors import UserError
from runtime.schema.rules import slurm_seconds

if TYPE_CHECKING:
    from runtime.schema.training_config import SizingConfig

GIB = 2**30


def _tokens(value: str | None) -> float | None:
    """300e9, 300000000000, 300B, 1.2T."""
    if value is None:
        return None
    text = value.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:], 1.0)
    try:
        tokens = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise UserError(f"--tokens {value!r} is not a number; e.g. --tokens 300e9 or --tokens 300B") from None
    if not math.isfinite(tokens) or tokens <= 0:  # inf, nan, and 1e400 (which float() reads as inf)
        raise UserError(f"--tokens {value!r} must be a finite positive number; e.g. --tokens 300e9 or --tokens 300B")
    return tokens


def compose_checked(overrides: list[str], vocab_size: int | None = None
                    ) -> tuple[LaunchConfig, SizingConfig | None]:
    """The resolved launch config for these overrides, with the training layout's arithmetic checked, and the
    schema's reading of what the training run is sized by (None where it has errors: estimate() names them)."""
    from launcher import validate
    from launcher.compose import compose, resolve
    from launcher.config import parse
    from launcher.estimator.shapes import vocab_for
    from runtime.schema.training import parse_sizing

    cfg = parse(resolve(compose(overrides)))
    training = cfg.composed_section("training")
    sizing, report = parse_sizing(training)  # read once: the vocabulary and the estimate
    try:
        vocab = vocab_for(sizing, vocab_size)
    except UserError:
        vocab = None  # estimate() says what it needs
    errors = validate.training(training, vocab_size=vocab) + validate.node_memory(cfg.cluster)
    if errors:
        raise UserError(*errors)
    return cfg, None if report.errors else sizing


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def _count(value: float) -> str:
    for unit, size in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f}"


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} hours"
    if seconds >= 120:
        return f"{seconds / 60:,.1f} minutes"
    return f"{seconds:,.3g} s"


def render(result, recipe: str, time_limit: str | None = None):
    """The estimate as rich renderables: a title line and three tables (device memory, host memory, time)."""
    return title_line(result, recipe), memory_table(result), host_table(result), time_table(result, time_limit)


def title_line(result, recipe: str) -> str:
    """The recipe, its parameters and the layout on the nodes, in one line."""
    shape, layout, hw = result.shape, result.layout, result.hardware
    vpp = f" (virtual {layout.vpp})" if layout.vpp > 1 else ""
    ep = f" · ep {layout.ep}" if layout.ep > 1 else ""
    # The context group is carved out of dp, as ep is: shown beside it, with the ranks that read distinct samples.
    context = (f" · cp {layout.cp}" if layout.cp > 1 else f" · ulysses {layout.ulysses}" if layout.ulysses > 1
               else "")
    if context:
        context += f" ({layout.batch_dp} reading distinct samples)"
    parameters = f"{_count(result.parameters.total)} parameters"
    if shape.moe is not None:  # total holds every expert; a token runs only its top_k of them
        parameters += (f" ({_count(result.parameters.active)} active: top-{shape.moe.top_k} of "
                       f"{shape.moe.num_experts} experts in {shape.num_moe_layers} of {shape.num_layers} layers)")
    return (f"{recipe}: {parameters} on {layout.num_nodes} × {layout.devices_per_node} {hw.description} · "
            f"tp {layout.tp} · pp {layout.pp}{vpp} · dp {layout.dp}{ep}{context} · "
            f"micro-batch {layout.micro_batch_size} × "
            f"{layout.num_micro_batches} · global batch {layout.global_batch_size} × seq {shape.seq_length}")


def memory_table(result):
    """Memory per device: each part of the stage's state and working set, then the total against the device's."""
    from rich.table import Table

    from launcher.estimator.memory import PRECISION_BYTES
    from runtime.schema.facts import PRECISION_POLICIES

    shape, layout, hw, mem = result.shape, result.layout, result.hardware, result.memory
    bytes_ = PRECISION_BYTES[layout.precision]
    stage = layout.zero_stage if layout.zero_stage is not None else int(bool(layout.zero1))
    group = f"shard group {layout.shard} of dp {layout.dp}" if layout.shard < layout.dp else f"dp {layout.dp}"
    sharded = f", ÷ {group} (ZeRO-{stage})" if stage and layout.shard > 1 else ""
    if sharded and shape.moe is not None and layout.ep > 1:  # experts' state: over the ranks holding those experts
        sharded = f", ÷ {group}, experts' ÷ {layout.expert_shard} (ZeRO-{stage})"
    recompute = layout.recompute or "no"
    if layout.recompute == "selective":
        recompute += " (" + ", ".join(layout.recompute_modules) + ")"
    memory = Table(title=f"memory per device ({mem.stage} pipeline stage, {_count(mem.parameters)} parameters)",
                   title_justify="left")
    memory.add_column("part")
    memory.add_column("GiB", justify="right")
    experts = ""
    if shape.moe is not None:
        experts = (f", all {shape.moe.num_experts} experts" if layout.ep == 1 else
                   f", {shape.moe.num_experts // layout.ep} of {shape.moe.num_experts} experts (ep {layout.ep})")
    memory.add_row(f"weights ({PRECISION_POLICIES[layout.precision].param}{experts})", _gib(mem.weights))
    memory.add_row("gradients (fp32 accumulation buffer)", _gib(mem.gradients))
    memory.add_row(f"optimizer (Adam moments{' + fp32 master' if bytes_.master else ''}{sharded})",
                   _gib(mem.optimizer))
    if mem.buffers:
        memory.add_row("buffers (RoPE tables)", _gib(mem.buffers))
    tokens = f", seq / {layout.context}" if layout.context > 1 else ""  # each rank's share of every sample
    memory.add_row(f"activations ({mem.in_flight:g} micro-batch(es) in flight, {recompute} recompute, "
                   f"sequence parallel {'on' if layout.sequence_parallel else 'off'}{tokens})", _gib(mem.activations))
    peak_part = "logits and loss" if mem.logits >= mem.backward else "one layer's backward"
    memory.add_row(f"peak working set ({peak_part})", _gib(max(mem.logits, mem.backward)))
    verdict = "[green]fits[/]" if result.fits else "[red]does not fit[/]"
    memory.add_row(f"[bold]total[/] vs {_gib(hw.usable_bytes)} usable of {_gib(hw.memory_bytes)}: {verdict}",
                   f"[bold]{_gib(mem.total)}[/]")
    return memory


def time_table(result, time_limit: str | None = None):
    """Time to train: FLOPs, the step time at the assumed MFU and by the layout model, and the jobs it takes."""
    from rich.table import Table

    shape, layout, hw = result.shape, result.layout, result.hardware
    time = Table(title=f"time (assumed MFU {result.mfu:.0%} of {hw.peak_tflops:g} TFLOP/s per device)",
                 title_justify="left")
    time.add_column("quantity")
    time.add_column("value", justify="right")
    step = result.step
    n = "N active" if shape.moe is not None else "N"
    time.add_row(f"model FLOPs per token (6·{n} + 3 × attention)", _count(result.flops_per_token))
    time.add_row("model FLOPs per step", _count(result.flops_per_step))
    time.add_row("step time at the assumed MFU", _duration(result.step_seconds_at_mfu))
    terms = [step.compute_s, step.bubble_s, step.tensor_parallel_s, step.data_parallel_s, step.pipeline_s]
    names = "compute + bubble + tp + dp + pp comms"
    if layout.ep > 1:
        terms.append(step.expert_parallel_s)
        names += " + ep all-to-all"
    if layout.context > 1:
        terms.append(step.context_parallel_s)
        names += " + cp ring K/V" if layout.cp > 1 else " + ulysses all-to-all"
    time.add_row(f"layout model: {names}",
                 " + ".join(f"{term:.3g}" for term in terms) + f" = {_duration(step.total_s)}")
    time.add_row("tokens", _count(result.tokens))
    time.add_row("[bold]time to train[/]", f"[bold]{_duration(result.days * 86400)}[/]")
    limit = slurm_seconds(str(time_limit)) if time_limit else None
    if limit:
        jobs = math.ceil(result.days * 86400 / limit)
        time.add_row(f"run.time_limit {time_limit}", "enough" if jobs <= 1 else
                     f"{jobs} jobs (resubmit; exp_manager.resume_if_exists continues)")
    return time


def host_table(result):
    """Host memory per node: one worker's parts, then the node's total against the node's memory."""
    from rich.table import Table

    from launcher.estimator.host import DATA_LOADER_FIXED_BYTES, PROCESS_OVERHEAD_BYTES

    host, layout = result.host, result.layout
    table = Table(title=f"host memory per node ({host.workers} workers, each holding only its own shard; the "
                        f"{host.stage} pipeline stage's worker)", title_justify="left")
    table.add_column("part, per worker")
    table.add_column("GiB", justify="right")
    table.add_row("shard state (weights, gradients, optimizer state as on the device)", _gib(host.shard_state))
    if host.working:
        table.add_row("activations and peak working set (on CPU the device is the host)", _gib(host.working))
    table.add_row("checkpoint staging (the ring an async save streams weights and optimizer state through)",
                  _gib(host.staging))
    table.add_row(f"data loader ({layout.global_batch_size // layout.batch_dp} rows of the global batch, + "
                  f"{DATA_LOADER_FIXED_BYTES // 2**20} MiB of indices)", _gib(host.data_loader))
    table.add_row(f"process (torch + runtime, {PROCESS_OVERHEAD_BYTES // 2**20} MiB measured)", _gib(host.process))
    table.add_row("[bold]per worker[/]", f"[bold]{_gib(host.per_worker)}[/]")
    verdict = "[green]fits[/]" if host.fits else "[red]does not fit[/]"
    table.add_row(f"[bold]node total[/]: {host.arithmetic()}: {verdict}", f"[bold]{_gib(host.total)}[/]")
    return table


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--device", type=click.Choice(["trn1", "trn2", "h100", "h200", "cpu"]), default=None,
              help="Target device; default: cluster.neuron.hardware for a neuron recipe, else from "
                   "trainer.accelerator and trainer.devices (neuron: trn2 with 64 per node, else trn1; gpu: h100).")
@click.option("--tokens", default=None, help="Token budget (300e9, 300B); default max_steps × global batch × seq.")
@click.option("--mfu", type=FiniteFloatRange(0.01, 1.0), default=None, help="Assumed model-FLOPs utilization.")
@click.option("--vocab-size", type=click.IntRange(1), default=None,
              help="Tokenizer vocabulary, when the tokenizer file is not on this machine.")
@click.option("--node-memory-gib", type=FiniteFloatRange(1), default=None,
              help="Host memory per node, GiB (default: cluster.node_memory_gib, else the instance's documented "
                   "memory; cpu: this machine's).")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def command(overrides, device, tokens, mfu, vocab_size, node_memory_gib) -> None:
    """Memory per device, host memory per node and time to train for a recipe (Hydra overrides as for a launch)."""
    import sys

    from rich.console import Console
    from rich.markup import escape

    from launcher.estimator import estimate

    token_budget = _tokens(tokens)  # before composing: a mistyped option is named first, and quickly
    cfg, sizing = compose_checked(list(overrides), vocab_size)
    training = cfg.stage("training")  # a run mapping: the schema has checked the section
    result = estimate(training.section, device=device, tokens=token_budget, mfu=mfu, vocab_size=vocab_size,
                      node_memory_bytes=node_memory_gib * GIB if node_memory_gib else cfg.cluster.node_memory_bytes,
                      neuron_hardware=cfg.cluster.neuron_hardware, sizing=sizing)
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("training=")), "training")
    title, memory, host, time = render(result, recipe, training.run.time_limit)
    # Pipes and logs are read later: do not fold at rich's default 80 columns there (as the launch table).
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    console.print(escape(title), soft_wrap=True)
    console.print(memory)
    console.print(host)
    console.print(time)
