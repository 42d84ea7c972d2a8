"""Each model.optim.name on the runtime's sharded optimizer next to its library's own optimizer object on a plain
copy of the same parameters, fed the same gradients: one process here, and under ZeRO-1 and ZeRO-2 dp2 in gloo
processes."""
from __future__ import annotations

import copy
import itertools

import schedulefree
import torch

from runtime.checkpoint.reshard import TIED
from runtime.models import build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, apply_data_parallel
from runtime.parallel.zero3 import full_parameters
from tests.runtime_parallel import harness as H

WEIGHT_DECAY = 0.1
LRS = (1e-2, 6e-3, 3e-3)  # a decaying schedule over the three steps
BETAS = (0.9, 0.95)

# name: (model.optim, the library's own optimizer over param groups at the first learning rate)
CASES = {
    "adamw": ({"name": "adamw", "betas": BETAS, "eps": 1e-6},
              lambda groups: torch.optim.AdamW(groups, lr=LRS[0], betas=BETAS, eps=1e-6, fused=True)),
    "adam": ({"name": "adam", "betas": BETAS, "eps": 1e-6},
             lambda groups: torch.optim.Adam(groups, lr=LRS[0], betas=BETAS, eps=1e-6, fused=True)),
    "sgd": ({"name": "sgd", "momentum": 0.9, "dampening": 0.1},
            lambda groups: torch.optim.SGD(groups, lr=LRS[0], momentum=0.9, dampening=0.1, fused=True)),
    "sgd_nesterov": ({"name": "sgd", "momentum": 0.9, "nesterov": True},
                     lambda groups: torch.optim.SGD(groups, lr=LRS[0], momentum=0.9, nesterov=True, fused=True)),
    "sgd_plain": ({"name": "sgd"}, lambda groups: torch.optim.SGD(groups, lr=LRS[0], fused=True)),
    "adafactor": ({"name": "adafactor"}, lambda groups: torch.optim.Adafactor(groups, lr=LRS[0])),
    "adamw_schedulefree": ({"name": "adamw_schedulefree", "betas": BETAS, "eps": 1e-6},
                           lambda groups: schedulefree.AdamWScheduleFree(groups, lr=LRS[0], betas=BETAS, eps=1e-6)),
    "sgd_schedulefree": ({"name": "sgd_schedulefree", "momentum": 0.9},
                         lambda groups: schedulefree.SGDScheduleFree(groups, lr=LRS[0], momentum=0.9)),
}
ELEMENTWISE = [case for case in CASES if case != "adafactor"]


def optim_cfg(case: str) -> dict:
    return {"lr": LRS[0], "weight_decay": WEIGHT_DECAY, **CASES[case][0]}


def build(case: str, topo: Topology, zero1: bool = False, seed: int = 1234, zero_stage: int | None = None):
    model = build_model(H.tiny_config("gpt", seed=seed))
    reference = copy.deepcopy(model)
    model = apply_data_parallel(model, topo, DataParallelConfig("fp32", zero1, zero_stage))
    return model, ShardedAdamW(model, optim_cfg(case)), reference


def gradients(step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s gradients, by the plain model's parameter names."""
    generator = torch.Generator().manual_seed(100 + step)
    model = build_model(H.tiny_config("gpt"))
    return {name: torch.randn(p.shape, generator=generator) * 0.1 for name, p in model.named_parameters()}


def _plain(name: str, plain: dict) -> str:
    """A tied model's output weight is its word embedding (data parallelism names it by the output layer)."""
    return name if name in plain else dict(zip(TIED, reversed(TIED)))[name]


def set_gradients(optimizer, grads: dict[str, torch.Tensor]) -> None:
    """This step's gradients into data parallelism's main gradients (what the reduction would have left; ZeRO-2:
    the rank's shard of the bucket's gradient, as its reduce-scatter leaves it)."""
    dp = optimizer.data_parallel
    names = {id(p): name for name, p in dp.named_params}
    for bucket in dp.buckets:
        if bucket.grads_sharded:
            flat = torch.cat([grads[_plain(names[id(p)], grads)].reshape(-1) for p in bucket.params])
            padded = torch.zeros(bucket.param_buffer.numel(), dtype=torch.float32, device=flat.device)
            padded[:flat.numel()] = flat
            bucket.grad_shard = padded[bucket.shard].clone()
            for seg in bucket.segments:
                seg.shard_grad = bucket.grad_shard[seg.in_shard]
            continue
        for seg in bucket.segments:
            if seg.main.value is None:
                seg.main.zeros(keep=False)
            seg.main.value.copy_(grads[_plain(names[id(seg.param)], grads)])


def step_ours(model, optimizer, step: int) -> None:
    set_gradients(optimizer, gradients(step))
    optimizer.step(LRS[step])


def library_run(case: str, reference, steps: int = 3, switch_after: int | None = None,
                evaluate: bool = False) -> dict[str, torch.Tensor]:
    """The library's own optimizer on the plain model: Megatron's groups (no decay for 1-D parameters).
    switch_after: schedule-free's eval() then train() after that step (as a checkpoint or a validation does);
    evaluate: its eval() at the end."""
    params = dict(reference.named_parameters())
    decay = [p for p in params.values() if p.dim() > 1]
    no_decay = [p for p in params.values() if p.dim() <= 1]
    library = CASES[case][1]([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay,
                                                                                "weight_decay": 0.0}])
    if hasattr(library, "train"):
        library.train()
    for step in range(steps):
        grads = gradients(step)
        for name, p in params.items():
            p.grad = grads[name].clone()
        for group in library.param_groups:
            group["lr"] = LRS[step]
        library.step()
        if step == switch_after and hasattr(library, "eval"):
            library.eval()
            library.train()
    if evaluate:
        library.eval()
    return {name: p.detach().clone() for name, p in params.items()}


def weights(model) -> dict[str, torch.Tensor]:
    """The weights of a model data parallelism applies to, by the plain model's names."""
    plain = dict(build_model(H.tiny_config("gpt")).named_parameters())
    return {_plain(name, plain): p.detach().clone() for name, p in model.data_parallel.named_params}


def max_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max((ours[n] - theirs[n]).abs().max().item() for n in ours)


def dp2_all_optimizers(directory: str) -> dict:
    """Every optimizer under ZeRO-1 dp2 (Adafactor under plain dp2: it refuses ZeRO-1) against its library on
    one process; and for each elementwise one, a checkpoint saved after two steps (resharded by the test); then
    each elementwise one under ZeRO-2 and ZeRO-3 dp2 (keys "<case>-zero2", "<case>-zero3"), no checkpoint."""
    import torch.distributed as dist

    from runtime.checkpoint import Checkpointer

    topo = Topology.build(ParallelDims(1, 1, 2, 2))
    out = {}
    for case in CASES:
        model, optimizer, reference = build(case, topo, zero1=case != "adafactor")
        for step in range(3):
            step_ours(model, optimizer, step)
            if step == 1 and case in ELEMENTWISE:
                Checkpointer(f"{directory}/{case}", rank=dist.get_rank(), world_size=2, token="0",
                             async_save=False).save(2, model, optimizer, topo, extra={"step": 2}, config={})
                dist.barrier()
        saved = 1 if case in ELEMENTWISE else None  # the checkpoint moved schedule-free to its eval point and back
        out[case] = max_difference(weights(model), library_run(case, reference, switch_after=saved))
    for case, stage in itertools.product(ELEMENTWISE, (2, 3)):
        model, optimizer, reference = build(case, topo, zero_stage=stage)
        assert all(bucket.grads_sharded for bucket in optimizer.data_parallel.buckets)
        for step in range(3):
            step_ours(model, optimizer, step)
        with full_parameters(model):  # ZeRO-3: the weights exist only as shards between forwards
            out[f"{case}-zero{stage}"] = max_difference(weights(model), library_run(case, reference))
    return out
