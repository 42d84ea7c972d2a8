# Our tensors read by slices straight from a Hugging Face directory's safetensors files (SlicedReader): what a
# rank reads of its starting weights (runtime/convert/pretrained.py), its own part and nothing else.
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from runtime.convert.hf_layout import (_BUFFER, VOCAB_ROWS, _check_names, _hf_shapes, _read_json, _Rule, _rules,
                                       check_weight, padded_rows, state_shapes)
from runtime.schema.model import ModelConfig
from runtime.schema.safetensors_file import hf_weights_problems


class SlicedReader:
    """Our tensors, or any selection of them, read straight from a Hugging Face directory's safetensors files:
    each HF part is opened lazily (safe_open) and only the rows or columns a selection needs are read, so a rank
    reading its TP shard of a fused QKV reads its q, k and v rows and nothing else. `available` is False when the
    directory is not this (reading only) path's case: .bin weights, or names other than transformers' current
    on-disk ones (prefix-less GPT-2, 5.x's fused Mixtral experts); read_pretrained then loads it whole."""

    def __init__(self, directory: str | os.PathLike, cfg: ModelConfig):
        from safetensors import safe_open

        self.directory, self.cfg = Path(directory), cfg
        self._open, self._handles = safe_open, {}
        self._rules = {rule.ours: rule for rule in _rules(cfg.unpadded())}  # the directory's rows, not our padding
        self.files = self._files()
        names = {name for rule in self._rules.values() for name in rule.hf}
        self.available = self.files is not None and names <= set(self.files)

    def _files(self) -> dict[str, Path] | None:
        problems = hf_weights_problems(self.directory)  # headers only, before any tensor is read
        if problems:
            raise ValueError(f"{problems[0]}; re-download it or use a complete copy")
        if (self.directory / "model.safetensors").is_file():
            return {name: self.directory / "model.safetensors"
                    for name in self._handle(self.directory / "model.safetensors").keys()}
        if (self.directory / "model.safetensors.index.json").is_file():
            index = _read_json(self.directory / "model.safetensors.index.json", "model.safetensors.index.json")
            return {name: self.directory / file for name, file in index.get("weight_map", {}).items()}
        return None

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = self._open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{file}: not a readable safetensors file ({error})") from None
        return self._handles[file]

    def _slice(self, hf_name: str):
        file = self.files[hf_name]
        try:
            return self._handle(file).get_slice(hf_name)
        except SafetensorError:  # an index that places the tensor in a file that does not hold it
            raise ValueError(f"{file}: has no tensor {hf_name}, which model.safetensors.index.json places there; "
                             "re-download the model or use a complete copy") from None

    def check(self) -> None:
        """The directory holds exactly the HF tensors the config implies (as the whole read, from_hf, requires),
        each of the shape it implies (from the headers alone)."""
        tied = self.cfg.share_embeddings_and_output_weights
        present = {n for n in self.files if not _BUFFER.match(n) and not (tied and n == "lm_head.weight")}
        _check_names(present, {name for rule in self._rules.values() for name in rule.hf}, "holds a state that")
        shapes = state_shapes(self.cfg.unpadded())
        for ours, rule in self._rules.items():
            for name, want in zip(rule.hf, _hf_shapes(rule, shapes[ours]), strict=True):
                have = tuple(self._slice(name).get_shape())
                if have != tuple(want):
                    raise ValueError(f"holds {name} (our {ours}) with shape {have} but the model config makes "
                                     f"{tuple(want)}")

    def read(self, ours: str, select: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Our tensor `ours` (a tied output head: the embedding) at `select` (dim -> full indices)."""
        if ours == "output.weight" and self.cfg.share_embeddings_and_output_weights:
            ours = "embed.word.weight"
        rule, select = self._rules[ours], dict(select or {})
        if ours in VOCAB_ROWS and self.cfg.padding_from is not None:
            return padded_rows(lambda rows: self._matrix(rule, rule.hf, {0: rows}), select, self.cfg, ours)
        per_matrix = len(rule.rows) or 1
        if rule.experts:
            experts = select.pop(0, torch.arange(rule.experts)).tolist()
            select = {dim - 1: index for dim, index in select.items()}
            return torch.stack([self._matrix(rule, rule.hf[e * per_matrix:(e + 1) * per_matrix], select)
                                for e in experts])
        return self._matrix(rule, rule.hf, select)

    def _matrix(self, rule: _Rule, parts: tuple[str, ...], select: dict) -> torch.Tensor:
        """One of our matrices (or vectors): the row-wise concatenation of `parts`, transposed if the rule says,
        read at `select` (at most one dim, unless a plain rename)."""

        def checked(name: str, tensor: torch.Tensor) -> torch.Tensor:
            check_weight(name, tensor, self.files[name])  # this rank's part: the ranks together check it all
            return tensor

        if len(parts) == 1 and not rule.transpose:  # a rename: the bounding box of every selected dim, then picked
            part = self._slice(parts[0])
            box = [slice(int(select[d].min()), int(select[d].max()) + 1) if d in select else slice(None)
                   for d in range(len(part.get_shape()))]
            block = checked(parts[0], part[tuple(box)])
            for d, index in select.items():
                block = block.index_select(d, index - box[d].start)
            return block
        if len(select) > 1:
            raise ValueError(f"{rule.ours}: a selection along more than one dim of a matrix is not supported")
        dim, index = next(iter(select.items())) if select else (None, None)
        if dim is not None and rule.transpose:
            dim = 1 - dim  # the dim of the stored (pre-transpose) matrix
        pieces = []
        if dim == 0:  # rows: each part gives the selected rows that fall in it
            out, start = None, 0
            for name, rows in zip(parts, rule.rows or (None,)):
                part = self._slice(name)
                rows = rows or part.get_shape()[0]
                inside = torch.nonzero((index >= start) & (index < start + rows)).flatten()
                if inside.numel():
                    wanted = index[inside] - start
                    lo, hi = int(wanted.min()), int(wanted.max()) + 1
                    block = checked(name, part[lo:hi]).index_select(0, wanted - lo)
                    if out is None:
                        out = block.new_empty((index.numel(), *block.shape[1:]))
                    out[inside] = block
                start += rows
            matrix = out
        else:
            for name in parts:
                part = self._slice(name)
                if dim == 1:
                    lo, hi = int(index.min()), int(index.max()) + 1
                    pieces.append(checked(name, part[:, lo:hi]).index_select(1, index - lo))
                else:
                    pieces.append(checked(name, part[:]))
            matrix = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return matrix.t().contiguous() if rule.transpose else matrix
