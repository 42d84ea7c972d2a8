# Loading checkpoints: into a model under any layout (load_checkpoint), or as whole tensors for conversion and
# tests (read_rank_files + full_tensors). Saving, committing and finding them is manager.py's.
#
# A format-2 load reads every rank file's index, then only the byte ranges of the pieces this rank holds under
# its own layout (reshard.py plans them, rankfile.py reads and checks them); the optimizer step, data position
# and RNG come from the rank's own file when the world size is unchanged, otherwise from rank 0's. Format-1
# checkpoints (a torch.save zip per rank) load as they always did: every file mapped, full tensors rebuilt.
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import torch

from runtime.checkpoint.integrity import DamagedCheckpoint, check_checkpoint, rank_file_names
from runtime.checkpoint.manager import COMMIT, FORMAT, Committed, _committed, _rank_file
from runtime.checkpoint.rankfile import DamagedFile, RankFile, mapped_pieces
from runtime.checkpoint.reshard import RangedSource
from runtime.checkpoint.shards import FullTensors, load_into
from runtime.checkpoint.storage import LocalStorage, Storage
from runtime.parallel.data_parallel import data_parallel_of


def verify(storage: Storage, checkpoint: Committed) -> None:
    """Every rank file of `checkpoint` against its COMMIT marker; DamagedCheckpoint names the first bad one."""
    problem = check_checkpoint(storage, checkpoint)
    if problem is not None:
        raise DamagedCheckpoint(f"checkpoint {storage.root}/{checkpoint.name} is damaged: {problem}")


def _format(storage: Storage, checkpoint: Committed) -> int:
    found = int(checkpoint.meta.get("format", 1))
    if found > FORMAT:
        raise ValueError(f"checkpoint {storage.root}/{checkpoint.name} is in format {found}, newer than this nxdt "
                         f"reads (formats 1 to {FORMAT}): load it with the version that wrote it")
    return found


def _open_rank_files(storage: Storage, checkpoint: Committed, filenames: list[str], *,
                     checked: bool) -> list[RankFile]:
    """The format-2 rank files `filenames` of `checkpoint`, their indexes read (and, unless `checked`, held
    against COMMIT's sizes and checksums)."""
    recorded = checkpoint.meta.get("files") or {}
    files = []
    try:
        for filename in filenames:
            files.append(RankFile(storage, f"{checkpoint.name}/{filename}",
                                  None if checked else recorded.get(filename)))
    except DamagedFile as problem:
        for file in files:
            file.close()
        raise DamagedCheckpoint(f"checkpoint {storage.root}/{checkpoint.name} is damaged: {problem}") from None
    return files


def _mapped(storage: Storage, key: str, path: str) -> dict:
    """A format-2 rank file at a local `path` (of `key`) as a header whose pieces hold memory-mapped tensors."""
    try:
        file = RankFile(LocalStorage(os.path.dirname(path) or "."), os.path.basename(path))
    except DamagedFile as problem:
        raise DamagedCheckpoint(f"{storage.root}/{key} cannot be read: {problem}") from None
    try:
        return mapped_pieces(file, path)
    finally:
        file.close()


def _load(storage: Storage, key: str, path: str) -> dict:
    try:
        return torch.load(path, mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001 - a damaged zip surfaces as several kinds of error
        raise DamagedCheckpoint(f"{storage.root}/{key} cannot be read: {' '.join(str(error).split())[:160]}") \
            from error


def read_rank_files(storage: Storage, checkpoint: Committed | str, *, verified: bool = False) -> list[dict]:
    """Every rank file of `checkpoint` (a Committed or a directory name; checked against COMMIT first unless
    `verified`), memory-mapped where the storage is a file system (S3 objects are downloaded to a temporary
    directory, mapped, and the directory removed at once: the mapping keeps them)."""
    if isinstance(checkpoint, str):
        name, checkpoint = checkpoint, _committed(storage, checkpoint)
        if checkpoint is None:
            raise ValueError(f"checkpoint {storage.root}/{name} is incomplete (no {COMMIT} marker)")
    if not verified:
        verify(storage, checkpoint)
    name = checkpoint.name
    keys = [k for k in storage.list(name) if re.search(r"/rank_\d{5}\.pt$", k)]
    indexed = _format(storage, checkpoint) >= 2
    files = []
    for key in keys:
        path, scratch = storage.local_path(key), None
        if path is None:
            scratch = tempfile.mkdtemp(prefix="nxdt_ckpt_load_")
            path = os.path.join(scratch, os.path.basename(key))
            storage.get_file(key, path)
        try:
            if indexed:
                files.append(_mapped(storage, key, path))
            else:
                files.append(_load(storage, key, path))
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)  # the mapping keeps the bytes alive
    if not files:
        raise DamagedCheckpoint(f"checkpoint {storage.root}/{name} has no rank files")
    return files


@contextlib.contextmanager
def ranged_full_tensors(storage: Storage, checkpoint: Committed):
    """The checkpoint's whole tensors, each read by byte ranges (checked block by block against COMMIT) when it is
    asked for: get(name, key), has, names, dtype, full_shape. A reader that takes one tensor at a time (the
    export) holds one; mapping the files instead (read_rank_files) would keep every page it touched resident.
    Format-1 checkpoints (one pickle per rank) come whole, through full_tensors."""
    if _format(storage, checkpoint) == 1:
        yield full_tensors(read_rank_files(storage, checkpoint))
        return
    with _ranged(storage, checkpoint, rank_file_names(checkpoint.meta), verified=False) as (_, source):
        yield source


@contextlib.contextmanager
def _ranged(storage: Storage, checkpoint: Committed, filenames: list[str], *, verified: bool, read: bool = True):
    """(the format-2 rank files `filenames`, opened; a RangedSource over them, or None when not `read`), closed on
    the way out; a damaged block read inside is named as the checkpoint's damage. verified: the caller has checked
    every byte against COMMIT; otherwise each index is held against COMMIT and each block read against its
    checksum."""
    opened = _open_rank_files(storage, checkpoint, filenames, checked=verified)
    source = None
    try:
        source = RangedSource(opened, verify=not verified, workers=storage.read_workers) if read else None
        yield opened, source
    except DamagedFile as problem:
        raise DamagedCheckpoint(f"checkpoint {storage.root}/{checkpoint.name} is damaged: {problem}") from None
    finally:
        if source is not None:
            source.close()
        for file in opened:
            file.close()


def full_tensors(files: list[dict]) -> FullTensors:
    return FullTensors(((n, p) for f in files for n, ps in f["model"].items() for p in ps),
                       ((n, p) for f in files for n, ps in f["optim"].items() for p in ps))


def load_checkpoint(storage: Storage, checkpoint: Committed, model, optimizer, topo, *, rank: int,
                    broadcast: Callable[[torch.Tensor, Any], None] | None = None, reader: bool = True,
                    with_optimizer: bool = True, verified: bool = False) -> dict:
    """Load `checkpoint` into this rank's model and optimizer, resharding from whatever layout saved it.
    Returns this rank's saved `extra` (or rank 0's when the world size changed) and the optimizer scalars.
    The model needs data parallelism applied (it owns the buffers loaded into); optimizer may be None when
    with_optimizer is False. A reader reads every rank file's index, then only the byte ranges this rank holds.
    verified: the caller has checked the files against COMMIT (resume does, together over every rank); otherwise
    each index is held against COMMIT and each block read against its checksum."""
    if with_optimizer and optimizer is None:
        raise ValueError("load_checkpoint: with_optimizer=True needs the optimizer to load the moments into")
    dp = data_parallel_of(model)
    same_world = checkpoint.meta.get("world_size") == topo.dims.world_size
    if _format(storage, checkpoint) == 1:
        files = read_rank_files(storage, checkpoint, verified=verified) if reader else None
        load_into(dp, optimizer, full_tensors(files) if files is not None else None, broadcast=broadcast,
                  with_optimizer=with_optimizer)
        if files is None:
            files = _headers(storage, checkpoint.name, rank if same_world else 0)
    else:
        wanted = rank_file_names(checkpoint.meta) if reader else [_rank_file(rank if same_world else 0)]
        with _ranged(storage, checkpoint, wanted, verified=verified, read=reader) as (opened, source):
            load_into(dp, optimizer, source, broadcast=broadcast, with_optimizer=with_optimizer)
        files = [file.header for file in opened]
    by_rank = {f["rank"]: f for f in files}
    own = by_rank.get(rank) if same_world else None
    header = own or by_rank.get(0) or files[0]
    scalars = header["optim_scalars"]
    if with_optimizer:
        optimizer.step_count = int(scalars["step"])
        optimizer.load_scalars(scalars.get("optimizer"))
        dp.load_sr_generator_state(scalars["sr_generator"])
    return {"extra": header["extra"], "same_world": same_world}


def _headers(storage: Storage, name: str, rank: int) -> list[dict]:
    """The one rank file a rank that did not read the weights still needs, for the step, data position and RNG
    state: its own when the world size is unchanged, rank 0's otherwise."""
    key = f"{name}/{_rank_file(rank)}"
    path = storage.local_path(key)
    if path is not None:
        return [_load(storage, key, path)]
    try:
        return [torch.load(io.BytesIO(storage.get_bytes(key)), weights_only=True)]
    except Exception as error:  # noqa: BLE001
        raise DamagedCheckpoint(f"{storage.root}/{key} cannot be read: {' '.join(str(error).split())[:160]}") \
            from error


def read_config(storage: Storage, checkpoint: Committed) -> dict:
    """The resolved training config saved with a checkpoint; a ValueError of one line when it is damaged."""
    from runtime.schema import rules

    key = f"{checkpoint.name}/config.yaml"
    if not storage.exists(key):
        raise ValueError(f"checkpoint {storage.root}/{checkpoint.name} has no config.yaml")
    config, problem = rules.checkpoint_config(storage.get_bytes(key), f"{storage.root}/{key}")
    if problem:
        raise ValueError(problem)
    return config
