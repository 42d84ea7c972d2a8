# How a model's starting values are defined, so that any rank can compute exactly its own part of any parameter
# without anything else existing on it (the model is built on the meta device; runtime/parallel shards it there
# and then materializes only what the rank holds).
#
# Every parameter has an Init: a kind (normal, uniform, zeros, ones) and a scale, decided on the unsharded model
# by module type (CausalLM.init_rules). The random kinds are defined tile by tile: the full tensor's last two dims
# are cut into TILE x TILE tiles (a 1-D tensor into runs of TILE), every index of the leading dims (an expert) is
# its own set of tiles, and each tile is drawn in fp32 from a CPU generator seeded by a hash of (seed, the
# parameter's full name, the tile's coordinates). A rank holding rows (or columns, or experts) draws only the tiles
# those meet; a tile is at most TILE x TILE values, so no full tensor is ever drawn. The values are a function of
# (seed, name, shape) alone: the same for every tp / pp / ep / dp layout and every device.
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Callable, Iterator

import torch
from torch import nn

TILE = 128  # a head's rows (head_dim 128 is the common size): a TP shard of a fused QKV meets few partial tiles

Selection = dict  # dim -> LongTensor of the full tensor's indices along it (absent dims: all of them)


@dataclasses.dataclass(frozen=True)
class Init:
    kind: str            # "normal" (scale = std) | "uniform" (values in [-scale, scale)) | "zeros" | "ones"
    scale: float = 0.0
    name: str | None = None  # whose values these are when not the parameter's own (a tied output head)
    seed: int | None = None  # drawn from this seed rather than the model's (LoRA adapters take apply_lora's)


def values(init: Init, name: str, seed: int, shape: tuple[int, ...], select: Selection | None = None
           ) -> torch.Tensor:
    """The fp32 values of full tensor `name` (shape `shape`) at `select`, as a new CPU tensor of the selected
    shape."""
    select = select or {}
    index = [select[d].long().cpu() if d in select else None for d in range(len(shape))]
    local = tuple(len(i) if i is not None else n for i, n in zip(index, shape))
    if init.kind in ("zeros", "ones"):
        return (torch.zeros if init.kind == "zeros" else torch.ones)(local)
    if init.kind not in ("normal", "uniform"):
        raise ValueError(f"unknown init kind {init.kind!r}")
    out = torch.empty(local)
    if not out.numel():
        return out
    source, seed = init.name or name, seed if init.seed is None else init.seed
    lead = max(len(shape) - 2, 0)
    leading = [range(n) if i is None else i.tolist() for i, n in zip(index[:lead], shape[:lead])]
    gen = torch.Generator(device="cpu")
    for position, coords in zip(itertools.product(*(range(len(r)) for r in leading)),
                                itertools.product(*leading)):
        _fill(out[position] if lead else out, init, f"{seed}/{source}/{','.join(map(str, coords))}",
              shape[lead:], index[lead:], gen)
    return out


def _fill(out: torch.Tensor, init: Init, key: str, shape: tuple, index: list, gen: torch.Generator) -> None:
    """out (1-D or 2-D) = the selected values of one matrix (or vector) of the full tensor, tile by tile."""
    groups = [_tile_groups(i, n) for i, n in zip(index, shape)]
    for tile in itertools.product(*groups):
        coords = tuple(block for block, _, _ in tile)
        digest = hashlib.blake2b(f"{key}/{coords}".encode(), digest_size=8).digest()
        gen.manual_seed(int.from_bytes(digest, "little"))
        extent = tuple(min(TILE, n - block * TILE) for block, n in zip(coords, shape))
        drawn = torch.empty(extent)
        if init.kind == "normal":
            drawn.normal_(0.0, init.scale, generator=gen)
        else:
            drawn.uniform_(-init.scale, init.scale, generator=gen)
        if len(tile) == 1:
            out[tile[0][1]] = drawn[tile[0][2]]
        else:
            (_, rows_out, rows_in), (_, cols_out, cols_in) = tile
            out[_grid(rows_out, cols_out)] = drawn[_grid(rows_in, cols_in)]


def _grid(rows, cols) -> tuple:
    """An index of the rows x cols block: two index tensors broadcast as a grid (not paired element by element)."""
    if isinstance(rows, torch.Tensor) and isinstance(cols, torch.Tensor):
        return rows[:, None], cols[None, :]
    return rows, cols


def _tile_groups(index: torch.Tensor | None, size: int) -> list[tuple[int, object, object]]:
    """Per tile along one dim that the selection meets: (tile, where its values go in the output, which of the
    tile's values): slices where they are runs (the common case), index tensors otherwise."""
    if index is None:
        return [(b, slice(b * TILE, min((b + 1) * TILE, size)), slice(None)) for b in range(-(-size // TILE))]
    groups = []
    blocks = index // TILE
    for b in torch.unique(blocks).tolist():
        where = torch.nonzero(blocks == b).flatten()
        inside = index[where] - b * TILE
        out = slice(int(where[0]), int(where[-1]) + 1) if _is_run(where) else where
        take = slice(int(inside[0]), int(inside[-1]) + 1) if _is_run(inside) else inside
        groups.append((b, out, take))
    return groups


def _is_run(index: torch.Tensor) -> bool:
    return bool(index.numel()) and int(index[-1]) - int(index[0]) + 1 == index.numel() and (
        index.numel() == 1 or bool((index[1:] - index[:-1] == 1).all()))


# A local parameter (name, tensor) -> (its full name, the full tensor's shape, its selection of the full tensor).
Where = Callable[[str, torch.Tensor], tuple[str, tuple, Selection]]


def unsharded(name: str, param: torch.Tensor) -> tuple[str, tuple, Selection]:
    return name, tuple(param.shape), {}


def meta_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Each parameter still on the meta device, once, under its first name."""
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta and id(param) not in seen:
            seen.add(id(param))
            yield name, param


def meta_bytes(model: nn.Module) -> int:
    """What materialize(model) will allocate for parameters, in bytes (fp32)."""
    return sum(param.numel() * 4 for _, param in meta_parameters(model))


@torch.no_grad()
def materialize(model: nn.Module, rules: dict[str, Init], seed: int, where: Where = unsharded) -> None:
    """Give every meta parameter of `model` real CPU storage holding its values (rules[full name], drawn at its
    selection), and every meta buffer its values (the owning module's reset_parameters computes them). A parameter
    under several names (a tied embedding) stays one parameter. Parameters already real are left as they are."""
    real: dict[int, nn.Parameter] = {}
    for name, param in meta_parameters(model):
        full, shape, select = where(name, param)
        if full not in rules:
            raise KeyError(f"no init rule for {full} (local {name})")
        tensor = values(rules[full], full, seed, shape, select)
        if tuple(tensor.shape) != tuple(param.shape):
            raise AssertionError(f"{name}: materialized {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        real[id(param)] = nn.Parameter(tensor.to(param.dtype), requires_grad=param.requires_grad)
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in real:
                module._parameters[key] = real[id(param)]
        meta_buffers = [key for key, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        for key in meta_buffers:
            buffer = module._buffers[key]
            module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype)
        if meta_buffers:
            if list(module.parameters(recurse=False)):  # reset_parameters would re-draw its parameters too
                raise AssertionError(f"{type(module).__name__}: no rule computes the meta buffers {meta_buffers} "
                                     "of a module with parameters")
            module.reset_parameters()  # computed tables (rotary cos/sin)

