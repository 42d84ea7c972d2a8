# Reassemble the unsharded weights from tensor-parallel shards: what a layout-independent checkpoint, a
# conversion to Hugging Face, or a test against the single-process model needs.
from __future__ import annotations

import torch
from torch import nn

from runtime.parallel import collectives as C
from runtime.parallel.plan import plan_of
from runtime.parallel.topology import Topology
from runtime.parallel.zero3 import full_parameters


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
    with full_parameters(model):  # ZeRO-3: gathered over DP for the duration
        return _gather_full_state_dict(model, topo)


def _gather_full_state_dict(model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
    """Every parameter under its unsharded name and shape, on every TP rank (collective over TP, and over EP for
    experts).

    Names match the model as build_model made it (ColumnParallelLinear keeps `weight`/`bias`; a replicated-KV
    projection's `kv_weight` folds back into its `weight`). Tied weights appear under both names, as in
    nn.Module.state_dict. Buffers are not included: the models derive theirs from the config.
    """
    tp, plan = topo.tp, plan_of(model)
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        placement = plan[name]
        if placement.expert:  # the EP group's experts, in rank order, then the TP slices of each
            param = C.gather_along(param.detach(), 0, topo.ep)
        if not placement.sharded or tp.size == 1:
            full[name] = param.detach().clone()
            continue
        dim, index, full_size = placement.dim, placement.index, placement.full_size
        name = plan.full_name(name)
        pieces = torch.empty((tp.size, *param.shape), dtype=param.dtype, device=param.device)
        C.all_gather_flat(pieces.view(-1), param.detach().reshape(-1), tp)
        indices = torch.empty((tp.size, index.numel()), dtype=index.dtype, device=index.device)
        C.all_gather_flat(indices.view(-1), index, tp)
        if name not in full:
            shape = list(param.shape)
            shape[dim] = full_size
            full[name] = torch.empty(shape, dtype=param.dtype, device=param.device)
        for piece, idx in zip(pieces, indices):
            # Replicated KV rows are written once per replica, with identical values.
            full[name].index_copy_(dim, idx, piece)
    return full
