# Embedding lookups with sparse gradients, and a tied embedding's second use as an alias Parameter: how data
# parallelism (runtime/parallel/data_parallel.py, whose header says why) sets a model's lookups up before it
# re-homes the parameters into flat buffers.
from __future__ import annotations

import torch
from torch import nn


def sparse_grads_work(device: torch.device) -> bool:
    """Whether the device has sparse tensors (CPU and CUDA do; XLA does not): a probe, not a device name check."""
    try:
        # check_invariants given explicitly: left implicit, torch warns about it once per process
        torch.sparse_coo_tensor(torch.zeros((1, 1), dtype=torch.long, device=device), torch.ones(1, device=device),
                                (1,), check_invariants=False).coalesce()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def split_tied_lookups(model: nn.Module, *, sparse: bool) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Turn on sparse gradients for embedding lookups where the device has them; give each tied one an alias
    Parameter (see the header). Returns (alias, owner) pairs."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    aliases = []
    for module in model.modules():
        if not isinstance(getattr(module, "sparse", None), bool):  # nn.Embedding, VocabParallelEmbedding
            continue
        module.sparse = sparse
        weight = module.weight
        if users[id(weight)] > 1 and weight.requires_grad:
            alias = nn.Parameter(weight.detach())  # same storage
            module.weight = alias
            aliases.append((alias, weight))
    return aliases
