# Loading one rank's tensors from the rank files of any saving layout, reading only the bytes it needs.
#
# Every saved piece and every tensor a loading rank holds is a selection of the full tensor F: along each dim,
# a list of F's indices (experts along dim 0, a TP shard's rows along its dim) or all of them. So a saved TP
# shard S = F[ix_(P_0, P_1, ...)] and the loading rank's tensor T = F[ix_(Q_0, Q_1, ...)], and what S gives T is
# their intersection, dim by dim: T[ix_(t_0, t_1, ...)] = S[ix_(p_0, p_1, ...)]. A ZeRO-1 piece holds a flat
# range of S; a ZeRO-1 optimizer shard wants a flat range of T.
#
# For each saved shard that meets the target, the intersection is cut into blocks contiguous in both S and T
# (one block when the layouts agree; one per run of rows for a dim-0 TP reshard), and each block's bytes are
# read from the pieces that hold them straight into the target's memory. Where the blocks would be many and
# small (a shard along dim 1 of a matrix: one per row), the rows of S that hold the intersection are checked and
# scattered a few MiB at a time straight from a mapping of the local file (from S3, through the reading thread's
# buffer), or, when ZeRO-1 cut the shard into several pieces, read into one buffer and scattered after. Which
# shards fill a target, and how, is planned once per layout (every layer's tensors share it). Coverage is
# tracked on the grid of selected rows: a target row no saved piece holds is named as an incomplete checkpoint.
# Duplicated shards (replicated KV heads) are read once. The index arithmetic is selection.py's.
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from runtime.checkpoint.rankfile import BLOCK, TASK, Read, RankFile, dtype_of, run_reads
from runtime.checkpoint.selection import (as_index, contiguous_blocks, restrict, row_major_strides, run_slice,
                                           scatter, select)
from runtime.parallel.optimizers import STATE_KEYS

TIED = ("embed.word.weight", "output.weight")  # one tensor in a tied model, whichever name a rank holds
# A shard's intersection with a target is read block by block, straight into the target, when it is at most
# selection.MAX_BLOCKS contiguous blocks of MIN_BLOCK_BYTES or more on average; otherwise it is scattered.
MIN_BLOCK_BYTES = 64 << 10
CHUNK_BYTES = 4 << 20  # a scattered span is checked and scattered this much at a time, while it is in the cache


@dataclass(frozen=True)
class Target:
    """What a loading rank holds of one full tensor: its shape, and per selected dim the full tensor's indices
    (experts along dim 0, the TP shard's rows along its dim)."""

    shape: tuple
    rows: dict  # dim -> LongTensor

    @classmethod
    def of(cls, plan, local: str, param: torch.Tensor) -> "Target":
        return cls(tuple(param.shape), plan.selection(local))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        for dim, index in sorted(self.rows.items()):
            full = full.index_select(dim, index)
        return full


def _key(rows: torch.Tensor | None) -> bytes | None:
    return None if rows is None else rows.long().numpy().tobytes()


def _rows_per_unit(row_bytes: int) -> int | None:
    """The fewest rows that make whole checksum blocks (None when that is more than a read task)."""
    unit = BLOCK // math.gcd(BLOCK, row_bytes)
    return unit if unit * row_bytes <= TASK else None


class _Shard:
    """One saved TP shard of one tensor's state (value, or one optimizer key): its selection of the full tensor
    and the pieces (file, flat start, record) that hold it, from one file or, under ZeRO-1, several."""

    def __init__(self, piece: dict, dtype: torch.dtype):
        self.full_shape = tuple(piece["full_shape"])
        self.shape = tuple(piece["shard_shape"])
        self.dtype = dtype
        self.rows: dict[int, torch.Tensor] = {}
        if piece.get("experts") is not None:
            self.rows[0] = piece["experts"].long()
        if piece["dim"] is not None:
            self.rows[piece["dim"]] = piece["index"].long()
        self.pieces: list[tuple[RankFile, int, dict]] = []
        self._inverse: dict[int, torch.Tensor] = {}

    def inverse(self, dim: int) -> torch.Tensor:
        """Full index along `dim` -> position in this shard, -1 where it holds none."""
        if dim not in self._inverse:
            inverse = torch.full((self.full_shape[dim],), -1, dtype=torch.long)
            inverse[self.rows[dim]] = torch.arange(self.rows[dim].numel())
            self._inverse[dim] = inverse
        return self._inverse[dim]

    def positions(self, wanted: dict, window_shape) -> list[tuple] | None:
        """Per dim (position in this shard, position in the window) of their common indices; None if none."""
        out = []
        for dim, full in enumerate(self.full_shape):
            mine, theirs = self.rows.get(dim), wanted.get(dim)
            if mine is None and theirs is None:
                out.append((slice(0, full), slice(0, window_shape[dim])))
            elif mine is None:
                out.append((run_slice(theirs), slice(0, theirs.numel())))
            elif theirs is None:
                out.append((slice(0, mine.numel()), run_slice(mine)))
            else:
                found = self.inverse(dim)[theirs]
                keep = found >= 0
                if not bool(keep.any()):
                    return None
                out.append((run_slice(found[keep]), run_slice(keep.nonzero()[:, 0])))
        return out

    def covering(self, start: int, stop: int, *, strict: bool = True) -> list[tuple]:
        """(file, record, first, stop element of the record, flat start in the shard) for the pieces that hold
        shard elements [start, stop), each element once; strict: raise when some are held by none."""
        found, at = [], start
        for file, first, record in sorted(self.pieces, key=lambda p: p[1]):
            lo, hi = max(at, first), min(stop, first + torch.Size(record["shape"]).numel())
            if hi <= lo:
                continue
            if lo > at and strict:
                break
            found.append((file, record, lo - first, hi - first, lo))
            at = hi
        if strict and at < stop:
            raise ValueError(f"checkpoint is incomplete: no saved piece holds elements {at} to {stop} of a "
                             f"{list(self.shape)} shard")
        return found


class RangedSource:
    """The pieces of every rank file of a checkpoint. fill() plans what one target needs; run() reads it all,
    in parallel, and finishes the targets that needed a scatter or a dtype change."""

    def __init__(self, files: list[RankFile], *, verify: bool, workers: int):
        self._shards: dict[tuple[str, str], dict[tuple, _Shard]] = {}
        for file in files:
            for section, keys in (("model", ("value",)), ("optim", (*STATE_KEYS, "master"))):
                for name, entries in file.header.get(section, {}).items():
                    for piece in entries:
                        geometry = (piece["dim"], _key(piece["index"]), tuple(piece["shard_shape"]),
                                    _key(piece.get("experts")))
                        for key in keys:
                            record = piece.get(key)
                            if not isinstance(record, dict):
                                continue
                            shards = self._shards.setdefault((name, key), {})
                            if geometry not in shards:
                                shards[geometry] = _Shard(piece, dtype_of(record))
                            shards[geometry].pieces.append((file, piece["start"], record))
        self.verify = verify
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="nxdt-checkpoint-read")
        self._reads: list[Read] = []
        self._after: list[list] = []  # per target, what runs once its reads are in
        self._layouts: dict[tuple, tuple] = {}  # see _layout
        self._arena = _Arena()

    def close(self) -> None:
        self._pool.shutdown()

    def _resolve(self, name: str, key: str) -> str:
        if (name, key) not in self._shards and name in TIED:
            other = TIED[1 - TIED.index(name)]
            if (other, key) in self._shards:
                return other
        return name

    def has(self, name: str, key: str) -> bool:
        return (self._resolve(name, key), key) in self._shards

    def full_shape(self, name: str, key: str = "value") -> tuple | None:
        shards = self._shards.get((self._resolve(name, key), key))
        return next(iter(shards.values())).full_shape if shards else None

    def dtype(self, name: str, key: str = "value") -> torch.dtype | None:
        shards = self._shards.get((self._resolve(name, key), key))
        return next(iter(shards.values())).dtype if shards else None

    def names(self) -> set[str]:
        return {name for name, _ in self._shards}

    def get(self, name: str, key: str) -> torch.Tensor | None:
        """The whole tensor, read by ranges now (FullTensors' get, without mapping the files)."""
        return self.read(name, key, {}) if self.has(name, key) else None

    def read(self, name: str, key: str, rows: dict) -> torch.Tensor:
        """The full tensor at `rows` (dim -> its indices, as Target's), reading only the byte ranges they need."""
        shape = self.full_shape(name, key)
        local = tuple(len(rows[d]) if d in rows else n for d, n in enumerate(shape))
        out = torch.empty(local, dtype=self.dtype(name, key))
        self.fill(name, Target(local, rows), 0, out.numel(), {key: (out.view(-1), key)})
        self.run()
        return out

    def fill(self, name: str, target: Target, lo: int, hi: int, outs: dict) -> None:
        """Plan filling, for each key, out (1-D) with elements [lo, hi) of the target's flattened tensor, read
        from the checkpoint's `source key` state of `name`: outs = {key: (out, source key)}."""
        shape = target.shape or (1,)
        row = math.prod(shape[1:])
        first_row, last_row = lo // row, -(-hi // row)
        wanted = dict(target.rows)
        if (first_row, last_row) != (0, shape[0]):  # only the rows of dim 0 that [lo, hi) touches
            wanted[0] = wanted.get(0, torch.arange(shape[0]))[first_row:last_row]
        window = _Window((last_row - first_row, *shape[1:]), wanted, lo - first_row * row, hi - first_row * row)
        for out, key in outs.values():
            self._fill(self._resolve(name, key), key, window, out)

    def _fill(self, name: str, key: str, window: "_Window", out: torch.Tensor) -> None:
        shards = self._shards[(name, key)]
        dtype = next(iter(shards.values())).dtype
        direct = (window.start, window.stop) == (0, math.prod(window.shape)) and dtype == out.dtype
        into = out.view(window.shape) if direct else self._arena.take(math.prod(window.shape), dtype).view(
            window.shape)
        planned, missing, rows = self._layout(shards, window)
        if missing:
            raise ValueError(f"checkpoint is incomplete: {key} of {name} is missing {missing} of {rows} rows")
        job: list = []
        for geometry, plan in planned:
            self._plan(shards[geometry], plan, into, job)
        if not direct:
            job.append(lambda: out.copy_(into.reshape(-1)[window.start:window.stop]))
        if job:
            self._after.append(job)

    def _layout(self, shards: dict, window: "_Window") -> tuple[list, int, int]:
        """The plans of the shards that fill `window` (duplicates left out) and how many of its selected rows none
        holds. The same for every key and every tensor of the same layout (each layer's), so computed once."""
        key = (window.key(), tuple((g, s.full_shape, s.dtype) for g, s in shards.items()))
        if key in self._layouts:
            return self._layouts[key]
        selected = sorted(set(window.wanted).union(*(s.rows for s in shards.values())))
        covered = torch.zeros([window.shape[d] for d in selected], dtype=torch.bool)
        planned = []
        for geometry, shard in shards.items():
            plan = window.plan(shard)
            if plan is None:
                continue
            if selected:
                if bool(covered[plan.mark(selected)].all()):
                    continue  # a duplicate of rows already planned (a KV head replicated over TP ranks)
                covered[plan.mark(selected)] = True
            else:
                covered.fill_(True)
            planned.append((geometry, plan))
        self._layouts[key] = planned, int((~covered).sum()), covered.numel()
        return self._layouts[key]

    def _plan(self, shard: _Shard, plan: "_Plan", window: torch.Tensor, job: list) -> None:
        blocks = plan.blocks if shard.dtype == window.dtype else None
        if blocks is not None:
            flat = window.view(-1)
            for start_p, start_t, n in blocks:
                for file, record, first, stop, at in shard.covering(start_p, start_p + n):
                    begin = start_t + at - start_p
                    self._reads.append(Read(file, record, first, stop, flat[begin:begin + stop - first]))
            return
        # The span of the shard's rows (along dim 0) that holds the intersection, scattered from a buffer.
        saved, wanted = plan.saved, plan.wanted
        strides = row_major_strides(shard.shape)
        low = sum((p.start if isinstance(p, slice) else int(p.min())) * s for p, s in zip(saved, strides))
        high = sum((p.stop - 1 if isinstance(p, slice) else int(p.max())) * s for p, s in zip(saved, strides)) + 1
        row = strides[0]
        first_row, last_row = low // row, -(-high // row)
        shard.covering(low, high)  # raises if part of what is needed was saved by no piece
        unit = _rows_per_unit(row * shard.dtype.itemsize)
        if unit:
            # Whole rows, in chunks of whole checksum blocks, each scattered from the mapping (or a buffer)
            # while it is in the cache: when one piece holds the span from its first element (no ZeRO-1 cut).
            first_row -= first_row % unit
            found = shard.covering(first_row * row, last_row * row, strict=False)
            if len(found) == 1 and found[0][2] == found[0][4] == first_row * row and found[0][3] == last_row * row:
                file, record = found[0][:2]
                chunk = unit * max(1, CHUNK_BYTES // (unit * row * shard.dtype.itemsize))
                shape = shard.shape[1:]

                def sink(first: int, values: torch.Tensor) -> None:
                    rows = restrict(saved[0], wanted[0], first // row, first // row + values.numel() // row)
                    if rows is not None:
                        view = values.view(values.numel() // row, *shape)
                        scatter(window, [rows[1], *wanted[1:]], select(view, [rows[0], *saved[1:]]))

                self._reads.append(Read(file, record, first_row * row, last_row * row, None, sink, chunk * row))
                return
        buffer = self._arena.take((last_row - first_row) * row, shard.dtype)
        for file, record, first, stop, at in shard.covering(first_row * row, last_row * row, strict=False):
            begin = at - first_row * row
            self._reads.append(Read(file, record, first, stop, buffer[begin:begin + stop - first]))
        saved = list(saved)
        saved[0] = (slice(saved[0].start - first_row, saved[0].stop - first_row) if isinstance(saved[0], slice)
                    else saved[0] - first_row)
        view = buffer.view(last_row - first_row, *shard.shape[1:])
        job.append(lambda: scatter(window, wanted, select(view, saved)))

    def run(self) -> None:
        """Read everything planned since the last run, then finish the targets (scatters and dtype changes; one
        job per target, the jobs in parallel)."""
        reads, jobs = self._reads, self._after
        self._reads, self._after = [], []
        run_reads(reads, self._pool, verify=self.verify)
        for done in [self._pool.submit(_run_job, job) for job in jobs]:
            done.result()
        self._arena.reset()


def _run_job(job: list) -> None:
    for step in job:
        step()


class _Arena:
    """Scratch memory for span buffers and target windows, reused from one run (bucket) to the next: memory
    that is already mapped takes a copy several times faster than a fresh allocation's first touch."""

    def __init__(self):
        self._buffer, self._used = torch.empty(0, dtype=torch.uint8), 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._used + nbytes > self._buffer.numel():  # slices taken earlier keep the old buffer alive
            self._buffer, self._used = torch.empty(max(nbytes, 2 * self._buffer.numel(), 64 << 20),
                                                   dtype=torch.uint8), 0
        view = self._buffer[self._used:self._used + nbytes].view(dtype)
        self._used += nbytes + -nbytes % 64
        return view

    def reset(self) -> None:
        self._used = 0


@dataclass
class _Plan:
    """One saved shard against one target window: positions per dim, and the contiguous blocks (or None)."""

    saved: list
    wanted: list
    blocks: list | None

    marks: dict = field(default_factory=dict)

    def mark(self, selected: list[int]) -> tuple:
        """Index of the window's selected-rows grid this shard covers (for the coverage mask)."""
        key = tuple(selected)
        if key not in self.marks:
            grid = [as_index(self.wanted[d]) for d in selected]
            self.marks[key] = tuple(ix.view([-1 if i == k else 1 for i in range(len(grid))])
                                    for k, ix in enumerate(grid))
        return self.marks[key]


class _Window:
    """The rows of a target one fill() writes."""

    def __init__(self, shape: tuple, wanted: dict, start: int, stop: int):
        self.shape, self.wanted, self.start, self.stop = shape, wanted, start, stop

    def key(self) -> tuple:
        return self.shape, tuple((dim, _key(rows)) for dim, rows in sorted(self.wanted.items()))

    def plan(self, shard: _Shard) -> _Plan | None:
        positions = shard.positions(self.wanted, self.shape)
        if positions is None:
            return None
        saved, wanted = [p for p, _ in positions], [t for _, t in positions]
        blocks = contiguous_blocks(saved, wanted, shard.shape, self.shape)
        if blocks is not None and len(blocks) > 1 and (sum(n for _, _, n in blocks) * shard.dtype.itemsize
                                                       < MIN_BLOCK_BYTES * len(blocks)):
            blocks = None
        return _Plan(saved, wanted, blocks)
