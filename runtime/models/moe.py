# A Mixtral-style sparse MoE block: a router picks top_k of num_experts SwiGLU experts per token, the experts run
# as two batched matmuls over all experts at once, and the outputs are summed back weighted by the router.
#
# Exactness is the design constraint (an expert-parallel run must reproduce one process bit for bit up to fp32
# rounding): every choice here is a deterministic function of the micro-batch's tokens in their order.
# - Routing: scores in fp32 (softmax, or sigmoid), top-k, optionally renormalized over the k chosen
#   (NxD Training's normalize_top_k_affinities, Mixtral's default).
# - Capacity: with a capacity factor c, expert e takes at most ceil(c * tokens * top_k / num_experts)
#   assignments, first come first served in (token, slot) order; the rest are dropped (their share of the
#   output is zero and the residual carries the token). `capacity_factor=None` is dropless.
# - Shapes: with a capacity, every expert's batch is exactly `capacity` rows (padded), so nothing about the
#   computation's shapes depends on the routing (what XLA needs to compile one graph for every step, and how
#   Switch/GShard and NxD Training run on accelerators). Dropless batches are as wide as the busiest expert's
#   count: less padding, but a data-dependent shape.
# - Load-balancing loss (Switch Transformer, as Mixtral and transformers compute it): num_experts *
#   sum_e f_e * P_e, where f_e is the number of (token, slot) assignments to e (before dropping) over the
#   tokens, and P_e the mean routing probability of e. Router z-loss: mean over tokens of logsumexp(logits)^2.
#   Both are per micro-batch; attach_aux_loss adds their gradient without changing what forward returns.
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.init import Init
from runtime.models.layers import SwiGLU

ROUTER_ACTIVATIONS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One micro-batch's routing: (N, k) experts and weights, the (N, E) logits and probabilities."""
    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, *, activation: str = "softmax", normalize: bool = True,
          score_bias: torch.Tensor | None = None, groups: int = 1, top_groups: int = 1, scale: float = 1.0
          ) -> Routing:
    """(N, E) router logits -> the top_k experts of each token and their weights, in fp32. DeepSeek-V3's routing
    (MoEConfig's score_bias, groups, top_groups, routed_scaling_factor): `score_bias` (E,) is added to the
    probabilities for choosing only; with `groups`, only the experts of each token's best `top_groups` groups
    (ranked by the sum of their two best biased scores) are eligible; the chosen weights are multiplied by `scale`
    (after normalizing)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1) if activation == "softmax" else torch.sigmoid(logits)
    if score_bias is None and groups == 1:
        weights, experts = torch.topk(probs, top_k, dim=-1)  # ties: the lower expert index, as torch.topk picks
    else:
        choice = probs if score_bias is None else probs + score_bias.float()
        if groups > 1:
            grouped = choice.view(choice.shape[0], groups, -1)                          # (N, G, E/G)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(top_groups, dim=-1).indices
            eligible = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(1, best, True)
            choice = choice.masked_fill(~eligible.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        experts = torch.topk(choice, top_k, dim=-1).indices
        weights = probs.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights * scale if scale != 1.0 else weights, logits, probs)


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """num_experts * sum_e (assignments to e / tokens) * (mean probability of e): 1.0 when perfectly balanced
    with top_k = 1 (top_k when every slot is balanced), larger as the router concentrates."""
    tokens = routing.probs.shape[0]
    # A sum of ones rather than torch.bincount, whose output size depends on the values: on XLA it read them back
    # to the host, once per MoE layer and micro-batch, cutting the step's graph there.
    assignments = routing.experts.flatten()
    counts = routing.probs.new_zeros(num_experts).index_add(0, assignments, torch.ones_like(assignments,
                                                                                             dtype=routing.probs.dtype))
    return num_experts * torch.sum(counts / tokens * routing.probs.mean(dim=0))


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's z-loss: mean of logsumexp(logits)^2, which keeps the router's logits small."""
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Assignments an expert takes per micro-batch; None: dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def arrival_positions(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(N, k) -> each (token, slot) assignment's 0-based place in its expert's queue, in (token, slot) order."""
    one_hot = F.one_hot(experts.flatten(), num_experts)          # (N*k, E)
    return ((one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1).view_as(experts)


def kept_assignments(experts: torch.Tensor, num_experts: int, limit: int | None) -> torch.Tensor:
    """(N, k) bool: which (token, slot) assignments their expert takes, first come first served in (token, slot)
    order, at most `limit` per expert."""
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    return arrival_positions(experts, num_experts) < limit


class AuxLossScaler(torch.autograd.Function):
    """Returns `output` unchanged; in backward also sends `scale` as the gradient of `aux_loss`, so the auxiliary
    loss is trained without being added to (or returned with) the model's per-token loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, grad_aux, None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`output`, through which backward also applies d(scale * aux_loss)."""
    return AuxLossScaler.apply(output, aux_loss, scale)


EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert activation on (..., 2F) columns interleaved [g0, u0, g1, u1, ...] -> (..., F): gate
    clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SelectionBias(nn.Module):
    """DeepSeek-V3's e_score_correction_bias (E,): added to the router's scores to choose experts, not to weigh
    them. A parameter, so checkpoints, resharding and exports carry it as every weight; no gradient reaches it (it
    only picks indices), so AdamW's step leaves it bitwise as it is (zero moments, and no weight decay on 1-D), its
    zero gradient adds nothing to the norm, and clipping scales nothing. What changes it is DeepSeek-V3's
    auxiliary-loss-free balancing (model.moe.router_bias_update_rate, Megatron's moe_router_bias_update_rate),
    after each optimizer step: bias_update below, which the train step hands the optimizer.

    `routed`: while the train step counts (start_counting), the (token, slot) assignments its training forwards
    routed to each expert, before any capacity drop; None otherwise (evaluation and reference scoring never count,
    nor does an activation checkpoint's recompute of a forward that already counted)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_experts))
        self.routed: torch.Tensor | None = None

    def init_rules(self, prefix: str) -> dict[str, Init]:
        return {f"{prefix}.bias": Init("zeros")}

    def count(self, experts: torch.Tensor) -> None:
        # Inside backward (_current_graph_task_id is -1 outside it) a forward runs only as a recompute.
        if self.routed is None or not (self.training and torch.is_grad_enabled()) or \
                torch._C._current_graph_task_id() != -1:
            return
        flat = experts.flatten()
        self.routed = self.routed.index_add(0, flat, torch.ones_like(flat, dtype=self.routed.dtype))


def start_counting(model: nn.Module) -> list[SelectionBias]:
    """The selection biases of `model` (this rank's part of it), each counting its routing from now on."""
    biases = [m.selection for m in model.modules() if isinstance(m, SparseMoE) and m.selection is not None]
    for bias in biases:
        bias.routed = torch.zeros(bias.bias.shape[0], dtype=torch.float32, device=bias.bias.device)
    return biases


def bias_update(loads: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: (L, E) assignments per expert over a step's whole global batch
    -> the (L, E) change of each layer's selection bias, rate * sign(mean load - load): an underloaded expert's bias
    rises by `rate`, an overloaded one's falls, one at the mean stays. Computed as sign(total - E * load), exact in
    fp32 for counts below 2^24 / E (the mean itself may not be a float)."""
    loads = loads.float()
    return rate * torch.sign(loads.sum(dim=-1, keepdim=True) - loads.shape[-1] * loads)


class SparseMoE(nn.Module):
    """(B, T, H) -> (B, T, H). Parameters: router.weight (E, H); experts' gate_up (E, H, 2F) and down (E, F, H),
    each expert's SwiGLU as in layers.SwiGLU (gate first, then up).

    Three switches make GPT-OSS's block: router_bias (router.bias (E,)), expert_bias
    (gate_up_bias (E, 2F) added before the activation, down_bias (E, H) after each expert's output is whole) and
    expert_activation="clamped_swiglu" (clamped_swiglu above, gate_up's columns interleaved gate/up per unit)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *, capacity_factor: float | None = None,
                 activation: str = "softmax", normalize_top_k: bool = True, aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, router_bias: bool = False, expert_bias: bool = False,
                 expert_activation: str = "swiglu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 score_bias: bool = False, groups: int = 1, top_groups: int = 1, scale: float = 1.0,
                 shared_ffn: int | None = None):
        super().__init__()
        if expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert_activation: {expert_activation!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")
        self.expert_activation, self.swiglu_alpha, self.swiglu_limit = expert_activation, swiglu_alpha, swiglu_limit
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe.top_k: {top_k} must be from 1 to num_experts ({num_experts})")
        if activation not in ROUTER_ACTIVATIONS:
            raise ValueError(f"moe.router_activation: {activation!r} is not one of {', '.join(ROUTER_ACTIVATIONS)}")
        self.num_experts, self.top_k, self.ffn = num_experts, top_k, ffn
        self.capacity_factor, self.activation, self.normalize_top_k = capacity_factor, activation, normalize_top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = nn.Linear(hidden, num_experts, bias=router_bias)
        self.gate_up = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn))
        self.down = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * ffn)) if expert_bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden)) if expert_bias else None
        # DeepSeek-V3's (route's score_bias, groups, top_groups, scale) and its shared experts: a SwiGLU every
        # token goes through beside the routed experts.
        self.groups, self.top_groups, self.scale = groups, top_groups, scale
        self.selection = SelectionBias(num_experts) if score_bias else None
        self.shared = SwiGLU(hidden, shared_ffn) if shared_ffn else None
        # How the experts are reached when they are spread over ranks (runtime/parallel/experts.py installs it):
        # None is one process holding them all. The model itself stays plain.
        self.parallel = None
        self.aux_scale = 1.0  # the train step sets it: how a micro-batch's loss is weighted in the global batch
        self.stats: dict[str, torch.Tensor] = {}  # the last forward's
        self._totals: list[dict[str, torch.Tensor]] = []  # every training forward's since step_stats read them
        # A usable module on its own; in a model, its values come from CausalLM.init_rules (runtime/models/init.py).
        for weight in (self.gate_up, self.down):
            nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        par = self.parallel
        if par is not None:
            x = par.enter(x)  # the whole micro-batch, as one process routes it (a sequence shard is gathered)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                              # (N, H)
        routing = route(self.router(tokens), self.top_k, activation=self.activation,
                        normalize=self.normalize_top_k,
                        score_bias=None if self.selection is None else self.selection.bias, groups=self.groups,
                        top_groups=self.top_groups, scale=self.scale)
        if self.selection is not None:
            self.selection.count(routing.experts)
        limit = capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        weights = routing.weights.to(x.dtype)
        if limit is None:
            kept = torch.ones_like(routing.experts, dtype=torch.bool)
            out = self._dispatch(tokens, routing.experts, weights)
        else:
            position = arrival_positions(routing.experts, self.num_experts)
            kept = position < limit
            out = self._dispatch_capacity(tokens, routing.experts, weights, position, limit)
        out = out.view(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        aux = self._aux_loss(routing)
        load = torch.zeros(self.num_experts, device=x.device).index_add(0, routing.experts.flatten(),
                                                                          kept.flatten().float())
        self.stats = {"aux_loss": aux.detach(), "dropped": 1.0 - kept.float().mean(), "kept": kept, "load": load}
        if self.training:
            self._totals.append(self.stats)
            if aux.requires_grad:
                out = attach_aux_loss(out, aux, self.aux_scale)
        return out if par is None else par.leave(out)

    def _aux_loss(self, routing: Routing) -> torch.Tensor:
        aux = routing.logits.new_zeros(())
        if self.aux_loss_coef:
            aux = aux + self.aux_loss_coef * load_balancing_loss(routing, self.num_experts)
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * router_z_loss(routing)
        return aux

    def _dispatch(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Dropless: every (token, slot) through its expert and back, weighted: (N, H). Assignments are sorted by
        expert (stable: token order within an expert), so each expert-parallel rank's share is one contiguous run
        for the all-to-all, which brings the results back in the same order."""
        N = tokens.shape[0]
        flat_expert = experts.flatten()
        order = torch.argsort(flat_expert, stable=True)
        flat_expert = flat_expert[order]
        flat_token = torch.arange(N, device=tokens.device).repeat_interleave(self.top_k)[order]
        rows = tokens[flat_token]                                                       # (N*k, H)
        if self.parallel is None:
            results = self.experts(rows, flat_expert, presorted=True)
        else:
            results = self.parallel.dispatch(self, rows, flat_expert)
        if self.down_bias is not None:  # whole on every rank: added at home, once, after the TP sum
            results = results + self.down_bias[flat_expert].to(results.dtype)
        out = tokens.new_zeros(tokens.shape)
        return out.index_add(0, flat_token, results * weights.flatten()[order].unsqueeze(-1))

    def _dispatch_capacity(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                           position: torch.Tensor, limit: int) -> torch.Tensor:
        """With a capacity: (E, limit, H) batches, assignment (t, s) in row position[t, s] of its expert's batch.
        Dropped assignments are written to a spare row past the end, cut off before the experts and read back as
        zeros, so every shape here is fixed by the micro-batch size alone (no masking by what was kept)."""
        N, H = tokens.shape
        flat_expert = experts.flatten()
        flat_token = torch.arange(N, device=tokens.device).repeat_interleave(self.top_k)
        row = position.flatten().clamp(max=limit)
        padded = tokens.new_zeros(self.num_experts, limit + 1, H).index_put((flat_expert, row), tokens[flat_token])
        padded = padded[:, :limit]
        out = self.expert_batches(padded) if self.parallel is None else self.parallel.exchange(self, padded)
        if self.down_bias is not None:
            out = out + self.down_bias.unsqueeze(1).to(out.dtype)
        out = F.pad(out, (0, 0, 0, 1))                                                  # the spare row: zeros
        results = out[flat_expert, row] * weights.flatten().unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add(0, flat_token, results)

    def experts(self, rows: torch.Tensor, expert: torch.Tensor, *, presorted: bool) -> torch.Tensor:
        """(R, H) rows, each through expert[r] of the experts this module holds, padded per expert to the busiest
        one's count; the results in the rows' order."""
        E = self.gate_up.shape[0]
        order = None if presorted else torch.argsort(expert, stable=True)
        if order is not None:
            rows, expert = rows[order], expert[order]
        counts = torch.bincount(expert, minlength=E)                                    # (E,)
        width = int(counts.max()) if expert.numel() else 0
        starts = torch.cumsum(counts, dim=0) - counts
        slot = torch.arange(expert.numel(), device=rows.device) - starts[expert]
        padded = rows.new_zeros(E, width, rows.shape[1]).index_put((expert, slot), rows)  # (E, C, H)
        out = self.expert_batches(padded)[expert, slot]
        if order is not None:
            out = out[torch.argsort(order)]  # back to the rows' order (the inverse permutation)
        return out

    def expert_batches(self, padded: torch.Tensor, *, summed: bool = True) -> torch.Tensor:
        """(E, C, H) -> (E, C, H): each expert's SwiGLU over its batch, two batched matmuls for all experts. Under
        tensor parallelism each rank holds a slice of every expert's hidden units: `parallel` sums the inputs'
        gradient and the outputs over TP, unless the caller does (summed=False: this rank's partial sums)."""
        par = self.parallel if summed else None
        if par is not None:
            padded = par.enter_experts(padded)
        gate_up = torch.bmm(padded, self.gate_up)                                       # (E, C, 2F)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias.unsqueeze(1)
        if self.expert_activation == "clamped_swiglu":
            hidden = clamped_swiglu(gate_up, self.swiglu_alpha, self.swiglu_limit)
        else:
            gate, up = gate_up.chunk(2, dim=-1)                                         # (E, C, F) each
            hidden = F.silu(gate) * up
        out = torch.bmm(hidden, self.down)                                              # (E, C, H)
        return out if par is None else par.leave_experts(out)


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """The weight of one micro-batch's auxiliary loss in the step's objective: 1 / (micro-batches in the global
    batch), the same averaging the token loss gets, so any split over micro-batches and ranks trains the same."""
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.aux_scale = scale


def step_stats(model: nn.Module, *, report: bool = True) -> dict[str, float]:
    """What the MoE layers of this rank did since the last call, for metrics: the auxiliary loss (summed over
    layers, averaged over micro-batches), the fraction of (token, slot) assignments dropped by capacity, and the
    expert load imbalance (busiest expert's tokens over the mean, averaged over layers); {} without MoE layers.
    Call it every step; with report=False it only forgets the step (no device-to-host copy on unlogged steps)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE) and m._totals]
    if not report or not layers:
        for layer in layers:
            layer._totals = []
        return {}
    rows = []  # per layer: aux loss, dropped fraction, imbalance; computed on the device, read back at once
    for layer in layers:
        totals, layer._totals = layer._totals, []
        load = torch.stack([t["load"] for t in totals]).sum(dim=0).float()
        rows.append(torch.stack([torch.stack([t["aux_loss"] for t in totals]).float().mean(),
                                 torch.stack([t["dropped"] for t in totals]).float().mean(),
                                 torch.where(load.sum() > 0, load.max() / load.mean().clamp(min=1e-30),
                                             torch.zeros_like(load.sum()))]))
    aux, dropped, imbalance = torch.stack(rows).sum(dim=0).tolist()  # one device-to-host transfer
    return {"moe_aux_loss": aux, "moe_tokens_dropped": dropped / len(layers),
            "moe_load_imbalance": imbalance / len(layers)}
