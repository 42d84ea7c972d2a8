# Text generation from a CausalLM (runtime/models), tensor-parallel or not, whole or split into pipeline stages: a
# KV cache per attention layer and `generate`, which prefills a batch of prompts and then decodes one token per step.
# It only calls the model's forward with a SequenceLayout, so LoRA adapters and tensor parallelism need nothing
# special here. Under pipeline parallelism every step runs through the stages in turn (PipelinedDecoding): each
# stage caches only its own layers, the last one picks the tokens and broadcasts them to the others.
#
#     tokens = generate(model, [[5, 9, 2], [7]], max_new_tokens=32, stop_ids={3}, pad_id=0)   # greedy
#     tokens = generate(model, prompts, max_new_tokens=32, stop_ids={3}, temperature=0.8, top_p=0.9, seed=7)
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from runtime.models.layers import Attention, RotaryEmbedding, SequenceLayout
from runtime.models.transformer import CausalLM, Embeddings
from runtime.parallel import collectives as C
from runtime.parallel.pipeline.p2p import P2P
from runtime.parallel.pipeline.stages import PipelineStageModel
from runtime.parallel.topology import Topology


class KVCache:
    """One attention layer's keys and values, preallocated to `max_length` positions.

    The buffers take their shape from the first update, (batch, max_length, ng, d) with ng the heads this rank
    computes, so under tensor parallelism each rank caches only its share. update() returns the filled prefix,
    so a decode step attends over the tokens so far, not the whole budget. With `fixed` (XLA) it returns the
    whole buffer instead: every decode step then has the same shapes, hence one compiled graph, and the
    SequenceLayout's mask is False over the positions not written yet. The buffers start at zero, because a
    masked key still meets a 0 weight in the softmax-times-values product and 0 * NaN would be NaN.
    """

    def __init__(self, max_length: int, fixed: bool = False):
        self.max_length = max_length
        self.fixed = fixed
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, ng, d = k.shape
        if self.k is None:
            self.k = k.new_zeros(B, self.max_length, ng, d)
            self.v = v.new_zeros(B, self.max_length, ng, d)
        assert self.length + T <= self.max_length, "KVCache: more tokens than the cache was sized for"
        # A tensor index rather than a slice: the written positions change every step, the graph does not.
        index = torch.arange(self.length, self.length + T, device=k.device)
        self.k.index_copy_(1, index, k)
        self.v.index_copy_(1, index, v)
        self.length += T
        if self.fixed:
            return self.k, self.v  # (B, max_length, ng, d)
        return self.k[:, :self.length], self.v[:, :self.length]  # (B, length, ng, d)


@contextmanager
def kv_caches(model: nn.Module, max_length: int, fixed: bool = False) -> Iterator[list[KVCache]]:
    """A fresh KVCache on every Attention of `model` for the duration of the block, removed afterwards (also on
    error), so the model is a plain model again outside it."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    caches = [KVCache(max_length, fixed) for _ in attentions]
    for attention, cache in zip(attentions, caches):
        attention.kv_cache = cache
    try:
        yield caches
    finally:
        for attention in attentions:
            attention.kv_cache = None


def check_generatable(model: nn.Module) -> None:
    """ValueError (one line) for the layouts generation does not support."""
    if not isinstance(model, (CausalLM, PipelineStageModel)):
        raise ValueError(f"generation needs a CausalLM (whole, or this rank's pipeline stage of one), not a "
                         f"{type(model).__name__}")
    if any(getattr(m, "sequence_parallel", False) for m in model.modules()):
        raise ValueError("generation does not support sequence parallelism: load the model with "
                         "sequence_parallel false (tensor parallelism alone is fine)")
    unbuilt = next((m.no_kv_cache for m in model.modules() if getattr(m, "no_kv_cache", None)), None)
    if unbuilt:
        raise ValueError(f"generation: {unbuilt} (model.architecture={model.cfg.architecture}) has no KV cache here; "
                         "generate with transformers from the exported model")
    if any(isinstance(m, (Embeddings, RotaryEmbedding)) and m.positions is not None for m in model.modules()):
        raise ValueError("generation does not support context parallelism: load the model with "
                         "context_parallel_size 1")


def check_settings(*, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ValueError (one line, naming the setting) for values generate() cannot use; callers may check early."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: {max_new_tokens!r} must be a positive integer")
    if not temperature >= 0:
        raise ValueError(f"temperature: {temperature!r} must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: {top_p!r} must be in (0, 1]")


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             stop_ids: Iterable[int] = (), temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             group_seeds: Sequence[int] | None = None, pad_id: int = 0, vocab_size: int | None = None,
             finished: Callable[[int, list[int]], bool] | None = None,
             topo: Topology | None = None) -> list[list[int]]:
    """The new tokens of each prompt, without the stop token that ended it.

    Prompts of different lengths run as one batch, left-padded with `pad_id`: the mask hides the pads from
    every real token and each row's positions start at 0 on its first real token, so a row gets exactly the
    tokens it gets alone (tests/generate). A row stops at its first token in `stop_ids` (which counts towards
    `max_new_tokens`), after `max_new_tokens`, or when its next token would need a position past the model's
    max_position_embeddings; the batch stops when every row has.

    temperature 0 is greedy (argmax; ties go to the lower id). Otherwise tokens are sampled from
    softmax(logits / temperature) cut to the top-p nucleus, on the CPU with a generator seeded by `seed`, so
    the draws are the same on every device and every tensor-parallel rank (which all hold the same gathered
    logits) and the same seed gives the same tokens. group_seeds, instead of `seed`: one seed per group of
    len(prompts) // len(group_seeds) consecutive rows, each group sampled from its own generator with the
    draws generate() over that group's rows alone with its seed makes, so a group's tokens do not depend on the
    rest of the batch (GRPO's G completions of a prompt, runtime/rl/rollout.py). vocab_size: only ids below it
    are generated (the model's vocabulary is padded past the tokenizer's). Every rank of a tensor-parallel or
    pipeline group must call this with the same arguments. finished(row, tokens so far): True ends that row after
    its latest token (lm-eval's stop strings, which the caller cuts the decoded text at).

    A pipeline stage (PipelineStageModel) decodes with the other stages of its pp group: `topo`'s, or when None
    that of the topology the model's data parallelism was built with. The tokens are those of one process.
    """
    check_generatable(model)
    check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    if not prompts:
        return []
    generators = _generators(len(prompts), seed, group_seeds)

    def choose(logits: torch.Tensor, active: list[bool]) -> torch.Tensor:
        return _choose(logits, temperature, top_p, generators, vocab_size, active)

    if isinstance(model, PipelineStageModel):
        next_tokens = PipelinedDecoding(model, _pipeline_topology(model, topo), choose)
    else:
        def next_tokens(ids: torch.Tensor, layout: SequenceLayout, active: list[bool]) -> torch.Tensor:
            return choose(model(ids, layout=layout)[:, -1], active)                    # (B, V) -> (B,)
    return _decode(model, prompts, next_tokens, max_new_tokens=max_new_tokens, stops=set(stop_ids), pad_id=pad_id,
                   finished=finished)


def _decode(model: nn.Module, prompts: Sequence[Sequence[int]],
            next_tokens: Callable[[torch.Tensor, SequenceLayout, list[bool]], torch.Tensor], *, max_new_tokens: int,
            stops: set[int], pad_id: int, finished: Callable[[int, list[int]], bool] | None) -> list[list[int]]:
    """generate()'s loop: prefill, then feed back each step's tokens (next_tokens(ids, layout, active) -> (B,) on
    the CPU, the same on every rank) until every row has ended. Every rank keeps the same books from them."""
    max_positions = model.cfg.max_position_embeddings
    lengths = [len(p) for p in prompts]
    for number, length in enumerate(lengths):
        if not 1 <= length <= max_positions:
            raise ValueError(f"prompt {number} has {length} tokens; a prompt needs 1 to {max_positions} "
                             f"(the model's max_position_embeddings): shorten it")
    # Token j of a row is fed back at position length + j, which must exist, except for the last one.
    budgets = [min(max_new_tokens, max_positions - length + 1) for length in lengths]
    device = next(model.parameters()).device
    fixed = fixed_shapes(device)
    B, T0, steps = len(prompts), max(lengths), max(budgets)
    S = T0 + steps - 1                                          # the cache: prompts, then every token fed back
    ids, valid, layout = _prefill(prompts, pad_id, S if fixed else T0, S)
    lengths_t = torch.tensor(lengths)
    out: list[list[int]] = [[] for _ in prompts]
    active = [True] * B
    was_training = model.training
    model.eval()  # no dropout: greedy must be deterministic
    try:
        with kv_caches(model, S, fixed):
            layout = SequenceLayout(layout.positions.to(device), layout.mask.to(device))
            tokens = next_tokens(ids.to(device), layout, active)                       # (B,) on CPU
            for step in range(steps):
                for row, token in enumerate(tokens.tolist()):
                    if not active[row]:
                        continue
                    if token in stops:
                        active[row] = False
                        continue
                    out[row].append(token)
                    active[row] = step + 1 < budgets[row] and not (finished is not None and finished(row, out[row]))
                if not any(active):
                    break
                fed = torch.tensor([t if a else pad_id for t, a in zip(tokens.tolist(), active)])[:, None]
                valid[:, T0 + step] = True  # finished rows keep a (harmless) token there too
                # A finished row's position may run past the table: clamp it, nothing reads that row any more.
                position = (lengths_t + step).clamp(max=max_positions - 1)[:, None]  # (B, 1)
                keys = valid[:, :S if fixed else T0 + step + 1]  # the cache's keys after this token is written
                layout = SequenceLayout(position.to(device), keys[:, None, None, :].to(device))  # (B, 1, 1, S)
                tokens = next_tokens(fed.to(device), layout, active)
    finally:
        model.train(was_training)
    return out


class PipelinedDecoding:
    """One forward step of generation through the stages of a pp group: the first stage embeds the step's ids and
    runs its layers (with their KV caches), each next stage receives the hidden states (B, T, H) and runs its own,
    and the last applies the final norm and the head and picks the next tokens, which it broadcasts to every
    stage, so all of them feed back the same tokens and end at the same step. With virtual stages a rank runs its
    chunks in turn, the hidden states going round the ranks (chunk v of pp rank r is global stage v * pp + r).

    Only the last stage picks tokens, so only its generators draw; the others' are never read. The sends of a
    step are waited for at its end, before the broadcast every stage joins, so nothing is left in flight."""

    def __init__(self, stage: PipelineStageModel, topo: Topology,
                 choose: Callable[[torch.Tensor, list[bool]], torch.Tensor]):
        assert topo.pp.size == stage.pp_size and topo.pp.rank == stage.pp_rank, (
            f"the model is pipeline stage {stage.pp_rank} of {stage.pp_size}, the topology's pp group says "
            f"{topo.pp.rank} of {topo.pp.size}")
        self.stage, self.pp, self.choose = stage, topo.pp, choose
        self.p2p = P2P(prev_rank=topo.prev_stage_rank, next_rank=topo.next_stage_rank)
        first = next(stage.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.steps = 0

    def __call__(self, ids: torch.Tensor, layout: SequenceLayout, active: list[bool]) -> torch.Tensor:
        """(B, T) ids of this step (every stage is given them) -> the (B,) next tokens on the CPU."""
        B, T = ids.shape
        tokens = torch.zeros(B, dtype=torch.long)
        try:
            for chunk in self.stage.chunks:
                if chunk.is_first:
                    x = ids
                else:
                    key = (self.steps, chunk.stage)
                    self.p2p.post_activation(key, (B, T, self.stage.cfg.hidden_size), self.dtype, self.device)
                    x = self.p2p.take(key)
                out = chunk(x, None, layout)  # the last stage's (B, T, V) logits; else hidden states (B, T, H)
                if chunk.is_last:
                    tokens = self.choose(out[:, -1], active)
                else:
                    assert out.dtype == self.dtype, f"stage {chunk.stage} sends {out.dtype}, not {self.dtype}"
                    self.p2p.send_activation(out)
        finally:
            self.p2p.finish()
        self.steps += 1
        shared = tokens.to(self.device)
        C.broadcast(shared, self.pp, src_index=self.pp.size - 1)
        return shared.cpu()


def _pipeline_topology(stage: PipelineStageModel, topo: Topology | None) -> Topology:
    """The topology a pipeline stage decodes in: `topo`, or the one its data parallelism holds."""
    if topo is None:
        topo = getattr(getattr(stage, "data_parallel", None), "topo", None)
    if topo is None:
        raise ValueError("generation from a pipeline stage needs its topology: pass topo= (the model has no data "
                         "parallelism that holds one)")
    return topo


def fixed_shapes(device: torch.device) -> bool:
    """Whether every decode step attends over the cache's whole length (one shape, so XLA compiles one graph)
    rather than over the tokens so far (less work: CPU and CUDA). True everywhere for now: which devices compile
    graphs is runtime/device.py's to say (the only module that branches on the device kind), not yet asked."""
    return True


def _generators(rows: int, seed: int, group_seeds: Sequence[int] | None) -> list[torch.Generator]:
    """One CPU generator per group of rows: `seed`'s for all of them, or one per group_seeds entry."""
    seeds = [seed] if group_seeds is None else list(group_seeds)
    if not seeds or rows % len(seeds):
        raise ValueError(f"group_seeds: {len(seeds)} seeds for {rows} prompts; give one seed per group of equally "
                         "many consecutive prompts")
    return [torch.Generator().manual_seed(s) for s in seeds]


def _prefill(prompts: Sequence[Sequence[int]], pad_id: int, width: int, S: int
             ) -> tuple[torch.Tensor, torch.Tensor, SequenceLayout]:
    """The left-padded (B, T0) prompt ids, the (B, S) cache positions holding real tokens (the decode positions
    open one per step) and the prefill's layout over the first `width` cache positions (T0, or S for XLA)."""
    lengths = [len(p) for p in prompts]
    B, T0 = len(prompts), max(lengths)
    pads = torch.tensor([T0 - n for n in lengths])
    ids = torch.full((B, T0), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, T0 - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
    valid = (torch.arange(S)[None, :] >= pads[:, None]) & (torch.arange(S)[None, :] < T0)
    # Causal over real keys; a pad query sees only itself, so no row of the mask is empty (SDPA would give NaN,
    # and a NaN key or value poisons even the queries that give it weight 0).
    causal = torch.ones(T0, width, dtype=torch.bool).tril()
    eye = torch.eye(T0, width, dtype=torch.bool)
    mask = causal & (valid[:, None, :width] | eye)              # (B, T0, width)
    positions = (torch.arange(T0)[None, :] - pads[:, None]).clamp(min=0)  # (B, T0)
    return ids, valid, SequenceLayout(positions, mask.unsqueeze(1))


def _choose(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator],
            vocab_size: int | None, active: list[bool]) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens on the CPU: argmax, or a top-p sample, each group of rows drawn from its
    own generator (a group whose rows have all finished draws nothing; its row's tokens are then 0)."""
    logits = logits[:, :vocab_size].float().cpu()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_p, 0.0)
    picked = torch.zeros(probs.shape[0], 1, dtype=torch.long)  # in sorted order under top_p
    size = probs.shape[0] // len(generators)
    for group, generator in enumerate(generators):
        rows = slice(group * size, (group + 1) * size)
        if any(active[rows]):
            # The same call on the same (size, V) block as generate() over these rows alone: the same draws.
            picked[rows] = torch.multinomial(probs[rows], 1, generator=generator)
    return (picked if order is None else order.gather(-1, picked)).squeeze(-1)
