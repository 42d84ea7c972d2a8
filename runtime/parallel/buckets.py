# The bookkeeping of runtime/parallel/data_parallel.py (read its header): a parameter's fp32 main gradient, a
# bucket (flat parameter and gradient buffers, the shard this rank owns, the groups it is reduced over), and the
# segments a shard is cut into, one per parameter it overlaps.
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from runtime.parallel.topology import AxisGroup


class MainGrad:
    """One parameter's fp32 gradient, accumulated over the micro-batches of a step."""

    __slots__ = ("shape", "device", "buffer", "value", "written")

    def __init__(self, param: nn.Parameter, buffer: torch.Tensor | None):
        self.shape, self.device = param.shape, param.device
        self.buffer = buffer        # a view of the bucket's flat grad buffer, or None (see the header)
        self.value = buffer         # what the optimizer reads; autograd's own tensor when there is no buffer
                                    # (None from zero_grad until the backward writes it)
        self.written = False        # False: the next gradient overwrites instead of adding

    def zeros(self, *, keep: bool) -> None:
        """Start from zeros; keep: allocate the missing buffer for good (sparse rows accumulate into it every
        step) rather than for this step only."""
        buffer = self.buffer
        if buffer is None:
            buffer = torch.empty(self.shape, dtype=torch.float32, device=self.device)
            if keep:
                self.buffer = buffer
        self.value = buffer.zero_()


@dataclasses.dataclass
class Segment:
    """The part of one parameter inside this rank's shard of a bucket."""

    param: nn.Parameter
    main: MainGrad
    in_param: slice      # range in param.view(-1)
    in_shard: slice      # the same elements' range in the bucket's shard tensors
    norm_weight: float   # 1 / (number of ranks holding an identical copy of this gradient)
    shard_grad: torch.Tensor | None = None  # ZeRO-2: the reduced gradient, a view of its bucket's grad_shard

    def grad(self) -> torch.Tensor:
        if self.shard_grad is not None:
            return self.shard_grad
        return self.main.value.view(-1)[self.in_param]


@dataclasses.dataclass
class Bucket:
    axis: AxisGroup                   # the ranks holding the same parameters: dp, or edp for experts
    shard_axis: AxisGroup             # the ranks the bucket is cut over under ZeRO: axis, or its hybrid shard group
    replica_axis: AxisGroup           # the ranks holding the same shard: hybrid's replica group, else one rank
    params: list[nn.Parameter]
    decay: bool                       # matrices (weight decay applies) or vectors: biases and norm weights
    param_buffer: torch.Tensor        # (padded,) param dtype; the params are views into it
    grad_buffer: torch.Tensor | None  # (padded,) fp32 when gradients must be flat; main grads are views into it
                                      # (ZeRO-2: only from the bucket's first gradient to its reduce-scatter)
    shard: slice                      # the part of the buffers this rank owns and updates
    master: torch.Tensor | None       # (shard,) fp32 master weights; None when the params are themselves fp32
    segments: list[Segment]
    uses: int = 0                     # hooks per backward: one per parameter, two for a tied embedding
    deferred: bool = False            # holds a gradient summed over another group first: reduced after backward
    grads_sharded: bool = False       # ZeRO-2 over more than one rank: grad_buffer lives only through backward
    grad_shard: torch.Tensor | None = None  # then: (shard,) fp32, the reduced gradient, kept until the next one
    param_shard: torch.Tensor | None = None  # ZeRO-3: (shard,) the rank's parameters; param_buffer only on demand


def accumulate(main: MainGrad, param: nn.Parameter) -> None:
    # Runs once per backward after autograd has summed this parameter's gradient, then drops .grad so the next
    # micro-batch starts from nothing (and bf16 gradients never accumulate in bf16). An alias's hook gets its
    # owner's MainGrad.
    grad = param.grad
    param.grad = None
    if grad.is_sparse:  # embedding rows: add them into a dense fp32 buffer, kept across steps
        if not main.written:
            main.zeros(keep=True)
        main.value.index_add_(0, grad._indices()[0], grad._values().to(torch.float32))
    elif main.written:
        main.value.add_(grad)
    elif main.buffer is not None:
        main.value = main.buffer.copy_(grad)
    else:
        main.value = grad  # already fp32 and no flat buffer needed: keep autograd's tensor
    main.written = True
