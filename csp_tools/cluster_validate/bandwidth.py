# Bandwidth arithmetic and the nccl-tests / nccom-test column layout. Pure and torch-free: the worker, the
# report, the launcher and the tests all share it.
#
# algbw = size / time. busbw = algbw x a factor that makes the number comparable with the link speed whatever the
# rank count (nccl-tests' doc/PERFORMANCE.md): each rank of a ring all_reduce sends and receives 2(n-1)/n of the
# buffer; all_gather, reduce_scatter and all_to_all move (n-1)/n of it; a broadcast moves it once.
from __future__ import annotations

from dataclasses import asdict, dataclass

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# torch dtype name -> (the name nccl-tests prints in its `type` column, bytes per element)
DTYPES = {"float32": ("float", 4), "bfloat16": ("bfloat16", 2), "float16": ("half", 2)}
GB = 1e9  # nccl-tests and nccom-test report decimal GB/s


def bus_factor(operation: str, ranks: int) -> float:
    if operation == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if operation in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    if operation == "broadcast":
        return 1.0
    raise ValueError(f"unknown operation {operation!r}; valid: {', '.join(OPERATIONS)}")


def sweep_sizes(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """min, min*f, min*f^2, ... up to max: nccl-tests' -b/-e/-f."""
    assert step_factor >= 2 and 1 <= min_bytes <= max_bytes, (min_bytes, max_bytes, step_factor)
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    return sizes


def aligned_size(operation: str, size: int, ranks: int, elem_bytes: int) -> int:
    """The size actually moved: whole elements, and for the split operations a whole number of elements per
    rank (as nccl-tests rounds its counts). Never zero."""
    unit = elem_bytes * (ranks if operation in ("all_gather", "reduce_scatter", "all_to_all") else 1)
    return max(unit, size // unit * unit)


def judged_size(sizes: list[int], judge_bytes: int) -> int:
    """The largest swept size not above judge_bytes (the smallest size when all are above it)."""
    below = [s for s in sizes if s <= judge_bytes]
    return max(below) if below else min(sizes)


@dataclass(frozen=True)
class Row:
    """One line of the table: one operation at one size, timed over every rank of one group."""

    operation: str
    size: int                # bytes: the buffer for all_reduce/broadcast/all_to_all, the gathered output for
    count: int               # all_gather, the input for reduce_scatter (nccl-tests' convention)
    type: str
    time_us: float           # mean time of one operation, averaged over the ranks
    algbw: float             # GB/s
    busbw: float             # GB/s
    wrong: int | None = None  # elements that failed the correctness check (None: not checked)
    ranks: int = 0
    source: str = "torch.distributed"  # or nccom-test
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.wrong

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Row:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def make_row(operation: str, size: int, dtype: str, seconds: float, ranks: int, wrong: int | None) -> Row:
    type_name, elem = DTYPES[dtype]
    algbw = size / seconds / GB if seconds > 0 else 0.0
    return Row(operation, size, size // elem, type_name, seconds * 1e6, algbw, algbw * bus_factor(operation, ranks),
               wrong, ranks)


def error_row(operation: str, size: int, dtype: str, ranks: int, error: str) -> Row:
    type_name, elem = DTYPES[dtype]
    return Row(operation, size, size // elem, type_name, 0.0, 0.0, 0.0, None, ranks, error=error)


def format_table(rows: list[Row], title: str) -> str:
    """The nccl-tests / nccom-test layout: one header, one line per size, the average bus bandwidth last."""
    lines = [f"# {title}",
             f"# {'size(B)':>12} {'count(elems)':>14} {'type':>9} {'time(us)':>12} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'#wrong':>7}"]
    for row in rows:
        if row.error:
            lines.append(f"  {row.size:>12} {row.count:>14} {row.type:>9}   error: {row.error}")
            continue
        wrong = "N/A" if row.wrong is None else str(row.wrong)
        lines.append(f"  {row.size:>12} {row.count:>14} {row.type:>9} {row.time_us:>12.2f} {row.algbw:>12.3f} "
                     f"{row.busbw:>12.3f} {wrong:>7}")
    timed = [row.busbw for row in rows if not row.error]
    if timed:
        lines.append(f"# Avg bus bandwidth: {sum(timed) / len(timed):.4f} GB/s")
    return "\n".join(lines)
