# Where our tensors live in a Hugging Face checkpoint, for every reader and writer of one (runtime/convert/hf.py
# whole, hf_slices.py by slices): the weight rules (one of our tensors <-> the HF tensors holding its values, from the
# architecture's `weights` module), the split and join that apply them, our shapes from a meta model, a source
# vocabulary's rows padded or cut back, and the checks every read makes (finite floating-point weights, the names
# the config implies).
from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from runtime.schema.families import architecture, family_for
from runtime.schema.model import ModelConfig
from runtime.models import meta_model

# What a Hugging Face directory may hold besides weights: GPT-2's old causal-mask buffers (with or without OpenAI's
# missing "transformer." prefix) and Llama's rotary inv_freq. Both readers drop them.
_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|"
                     r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def check_weight(name: str, tensor, where) -> None:
    """A starting weight is a floating-point tensor with finite values: anything else (an int64 tensor cast
    silently, NaN or inf that only shows as a NaN loss steps later) is refused naming the tensor and its file."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{where}: {name} is a {type(tensor).__name__}, not a tensor; give a model's weights")
    if not tensor.is_floating_point():
        raise ValueError(f"{where}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, not floating "
                         f"point; these are not a model's weights (re-save them as float32/bfloat16)")
    # By chunks of 16M values: a whole-tensor mask would add a byte per value to the reader's peak (an output head
    # of 53248 x 16384 is 870 MB of mask), the bound every reader of weights keeps to.
    count, first = 0, None
    for chunk in tensor.reshape(-1).split(1 << 24):
        bad = chunk[~torch.isfinite(chunk)]
        count += bad.numel()
        first = bad[0].item() if first is None and bad.numel() else first
    if count:
        raise ValueError(f"{where}: tensor {name} holds NaN or inf values ({count} of the {tensor.numel()} read, "
                         f"first: {first}); these weights are damaged or diverged: use another copy")


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One of our tensors and the HF tensor(s) holding the same values."""

    ours: str
    hf: tuple[str, ...]           # several names: our fused weight is their row-wise concatenation, in order
    rows: tuple[int, ...] = ()    # the parts' row counts when len(hf) > 1
    transpose: bool = False       # GPT-2's Conv1D stores (in, out), the transpose of nn.Linear
    experts: int = 0              # ours stacks this many per-expert matrices on dim 0; HF stores each expert's
                                  # parts separately, expert by expert (rows and transpose apply per expert)


def _rules(cfg: ModelConfig) -> list[_Rule]:
    """Every tensor of ours and the HF tensors holding it: the architecture's weight names (its registry entry's
    `weights` module: weight_rules(cfg, _Rule, the Hugging Face family cfg is, for its own MoE names)), and the
    output head unless it is tied."""
    weights = importlib.import_module(architecture(cfg.architecture).weights)
    rules = weights.weight_rules(cfg, _Rule, family_for(cfg))
    if not cfg.share_embeddings_and_output_weights:
        rules.append(_Rule("output.weight", ("lm_head.weight",)))
    return rules


def _split(rule: _Rule, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Our tensor -> its HF tensors in rule.hf's order, as views: per expert, transposed, then split by rows."""
    parts = []
    for matrix in tensor.unbind(0) if rule.experts else (tensor,):
        matrix = matrix.t() if rule.transpose else matrix
        parts += matrix.split(list(rule.rows)) if rule.rows else [matrix]
    return parts


def _join(rule: _Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of _split: HF tensors in rule.hf's order -> our (contiguous unless a plain rename) tensor."""
    per_matrix = len(rule.rows) or 1
    matrices = []
    for start in range(0, len(parts), per_matrix):
        group = parts[start:start + per_matrix]
        matrix = torch.cat(group) if len(group) > 1 else group[0]
        matrices.append(matrix.t().contiguous() if rule.transpose else matrix)
    return torch.stack(matrices) if rule.experts else matrices[0]


def state_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every full-state name and shape, from a model on the meta device (no memory, no init)."""
    return {name: tensor.shape for name, tensor in meta_model(cfg).state_dict().items()}


def _hf_shapes(rule: _Rule, shape: torch.Size) -> list[torch.Size]:
    return [part.shape for part in _split(rule, torch.empty(shape, device="meta"))]  # one owner of the layout


# Our tensors with a row per vocabulary entry: a source's vocabulary padded by ModelConfig (unpadded_vocab_size)
# gets zero rows here on load, and loses them again on export, so an export has exactly the source's shapes.
VOCAB_ROWS = ("embed.word.weight", "output.weight")


def pad_vocab(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A source's full state (its vocabulary's rows) -> cfg's padded rows, zero (a tied head stays the embedding)."""
    if cfg.padding_from is None:
        return state
    padded: dict[int, torch.Tensor] = {}
    out = dict(state)
    for name in VOCAB_ROWS:
        tensor = state.get(name)
        if tensor is not None and tensor.shape[0] == cfg.padding_from:
            if id(tensor) not in padded:
                rows = tensor.new_zeros((cfg.vocab_size - cfg.padding_from, *tensor.shape[1:]))
                padded[id(tensor)] = torch.cat([tensor, rows])
            out[name] = padded[id(tensor)]
    return out


def padded_rows(read: Callable[[torch.Tensor], torch.Tensor], select: dict[int, torch.Tensor], cfg: ModelConfig,
                name: str) -> torch.Tensor:
    """A vocabulary matrix `name` of a model padding its source's rows, at `select` (dim 0 -> indices over cfg's
    rows; none: all): the source's rows as read(indices) reads them, zeros for the padding."""
    if set(select) - {0}:
        raise ValueError(f"{name}: only rows of a padded vocabulary are selected, not dims {sorted(select)}")
    index = select.get(0, torch.arange(cfg.vocab_size))
    real = index < cfg.padding_from
    if bool(real.any()):
        block = read(index[real])
    else:  # a shard of padding alone: one row read for the dtype and width
        block = read(torch.zeros(1, dtype=torch.long))[:0]
    out = block.new_zeros((index.numel(), *block.shape[1:]))
    out[real] = block
    return out


class _Unpadded(Mapping):
    """A (lazy) full state with its vocabulary rows cut to the source's: each tensor read when asked for."""

    def __init__(self, state: Mapping[str, torch.Tensor], cfg: ModelConfig):
        self._state, self._cfg = state, cfg
        self.dtype = getattr(state, "dtype", None)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._state[name]
        if name in VOCAB_ROWS and tensor.shape[0] == self._cfg.vocab_size:
            return tensor[:self._cfg.padding_from]  # a view: the first rows of a row-major tensor are contiguous
        return tensor

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def unpadded_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig
                   ) -> tuple[Mapping[str, torch.Tensor], ModelConfig]:
    """Our full state and config -> the source's (cfg.unpadded()): the padded vocabulary rows dropped, as export
    writes them. A plain dict stays a dict (of views); a lazy mapping stays lazy."""
    if cfg.padding_from is None:
        return state, cfg
    unpadded = _Unpadded(state, cfg)
    return ({name: unpadded[name] for name in state} if isinstance(state, dict) else unpadded), cfg.unpadded()


def _check_names(state: dict, expected: dict, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} does not match the model config: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)")


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what}: {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{what}: {str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {str(path)!r} does not hold a JSON object")
    return data
