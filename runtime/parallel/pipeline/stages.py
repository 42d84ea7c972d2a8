# Split a (tensor-parallelized) CausalLM into pipeline stages by layers: the embedding on the first stage, the final
# norm, output head and loss on the last. With virtual stages (interleaved schedule) each rank holds `vpp` model
# chunks; chunk v of pp rank r is global stage v * pp + r, so the stages visit the ranks round-robin.
#
# The full model is built (and initialized) first and sliced afterwards, so every layout starts from the same
# weights. Parameter names stay those of the full model (`layers.3.attn.qkv.weight`), so checkpoints and the
# tests compare stage by stage against the single-process model by name.
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from runtime.models.layers import mask_padded_vocab
from runtime.models.transformer import CausalLM
from runtime.parallel.plan import ShardingPlan
from runtime.parallel.topology import Topology
from runtime.schema import rules


def split_layers(num_layers: int, num_stages: int, cuts: Sequence[int] | None = None) -> list[range]:
    """Layer index ranges, one per global stage, in stage order. cuts (NxD Training's model.pipeline_cuts): the
    last layer of every stage but the last, e.g. [18, 39, 60] puts layers 0-18, 19-39, 40-60 and 61-79 of 80 on
    four stages, so the first and last stages, which also hold the embedding and the head, hold fewer. Without
    cuts, uneven splits give the extra layers to the earliest stages (the last stage already carries the output
    head and the loss)."""
    if problem := rules.layers_split(num_layers, num_stages, 1, "", None if cuts is None else tuple(cuts)):
        raise ValueError(problem)
    return rules.stage_layers(num_layers, num_stages, None if cuts is None else tuple(cuts))


class PipelineChunk(nn.Module):
    """One global stage: [embed] -> layers -> [final norm -> head -> per-token loss]. Views of the full model's
    modules (no copies), owned for naming and the optimizer by the rank's PipelineStageModel."""

    def __init__(self, model: CausalLM, stage: int, num_stages: int, layer_ids: range):
        super().__init__()
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == num_stages - 1
        self.embed = model.embed if self.is_first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layer_ids)
        if self.is_last:
            self.final_norm, self.output = model.final_norm, model.output
            self.loss_fn, self.gather_vocab = model.loss_fn, model.gather_vocab
            self.padding_from = model.cfg.padding_from

    def forward(self, x, labels=None, layout=None):
        """First stage: input_ids (B, T); otherwise the previous stage's hidden states (B, T[/tp], H).
        Last stage: per-token loss (B, T) with labels, logits without; otherwise hidden states for the next.
        layout: the micro-batch's SequenceLayout (packed examples), which every stage rebuilds from its batch."""
        h = self.embed(x, None if layout is None else layout.positions) if self.is_first else x
        for layer in self.layers:
            h = layer(h) if layout is None else layer(h, layout)
        if not self.is_last:
            return h
        logits = self.output(self.final_norm(h))
        if labels is None:
            return mask_padded_vocab(self.gather_vocab(logits), self.padding_from)
        return self.loss_fn(logits, labels)


class PipelineStageModel(nn.Module):
    """What one pp rank holds: its model chunks, with parameters registered under the full model's names.

    `chunks[v]` is global stage v * pp + pp_rank. Only the canonical attributes (embed, layers.<i>, final_norm,
    output) register modules; the chunks are a plain list of views, so nothing is listed twice.
    """

    def __init__(self, model: CausalLM, topo: Topology, plan: ShardingPlan, virtual_pp: int,
                 sequence_parallel: bool, cuts: Sequence[int] | None = None):
        super().__init__()
        pp, rank = topo.pp.size, topo.pp.rank
        num_stages = pp * virtual_pp
        ranges = split_layers(model.cfg.num_layers, num_stages, cuts)
        self.cfg = model.cfg
        self.pp_size, self.pp_rank, self.virtual_pp = pp, rank, virtual_pp
        self.sequence_parallel = sequence_parallel
        self.tp_size = topo.tp.size
        stages = [v * pp + rank for v in range(virtual_pp)]
        tied = model.cfg.share_embeddings_and_output_weights
        if stages[0] == 0:
            self.embed = model.embed
            if tied:
                plan.mark("embed.word.weight", pipeline_tied=True)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for s in stages for i in ranges[s]})
        if stages[-1] == num_stages - 1:
            self.final_norm = model.final_norm
            if tied:
                _untie_output(model)
                plan.mark("output.weight", pipeline_tied=True)
            self.output = model.output
        chunks = [PipelineChunk(model, s, num_stages, ranges[s]) for s in stages]
        object.__setattr__(self, "chunks", chunks)  # not registered: views of the modules above
        self.layer_ranges = [ranges[s] for s in stages]

    def tie_weights(self) -> None:
        """Nothing to re-tie inside one stage: a tied embedding lives on the first and last stages, kept equal by
        summing their gradients (data parallelism's reduction) rather than by sharing storage."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through a schedule (runtime.step.train_step / eval_step), "
                           "not by calling it")


def _untie_output(model: CausalLM) -> None:
    # The last stage gets its own copy of the shared embedding: equal values, as a model built whole has them, or
    # on the meta device the embedding's by its init rule (runtime/models/init.py: a tied head takes its values).
    # Both copies are marked pipeline-tied in the plan, so data parallelism sums their gradients over the
    # embedding group and the global norm counts the gradient once.
    old = model.output.weight
    model.output.weight = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)


def split_into_stages(model: CausalLM, topo: Topology, plan: ShardingPlan, *, virtual_pp: int | None,
                      sequence_parallel: bool, cuts: Sequence[int] | None = None) -> PipelineStageModel:
    """This rank's stage of `model`; marks the pipeline ties in `plan`. cuts: see split_layers."""
    vpp = virtual_pp or 1
    if vpp < 1:
        raise ValueError(f"model.virtual_pipeline_model_parallel_size must be >= 1, got {virtual_pp}")
    return PipelineStageModel(model, topo, plan, vpp, sequence_parallel and topo.tp.size > 1, cuts)
