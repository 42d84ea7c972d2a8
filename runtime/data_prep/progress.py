"""Progress for people watching a terminal (a rich bar) and for Slurm logs (a line every log_interval_s)."""
from __future__ import annotations

import sys
import time


def _rates(docs: int, tokens: int, text_bytes: int, seconds: float) -> str:
    seconds = max(seconds, 1e-6)
    return (f"{docs / seconds:,.0f} docs/s  {text_bytes / seconds / 1e6:,.1f} MB/s  "
            f"{tokens / seconds / 1e3:,.0f}k tok/s")


class Reporter:
    """`log` for events, `start`/`update`/`finish` for the shard being tokenized."""

    def __init__(self, prefix: str, interval_s: float = 30.0, tty: bool | None = None):
        self.prefix, self.interval_s = prefix, interval_s
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._bar = None
        self._task = None
        if self.tty:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[rates]}"), TimeElapsedColumn())
            self._bar.start()

    def log(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {self.prefix}: {message}"
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def start(self, name: str, total_bytes: int) -> None:
        self._name, self._total = name, max(1, total_bytes)
        self._started = self._last = time.monotonic()
        if self._bar is not None:
            self._task = self._bar.add_task(name, total=self._total, rates="")

    def update(self, position: int, docs: int, tokens: int, text_bytes: int) -> None:
        now = time.monotonic()
        rates = _rates(docs, tokens, text_bytes, now - self._started)
        if self._bar is not None:
            self._bar.update(self._task, completed=min(position, self._total), rates=rates)
        elif now - self._last >= self.interval_s:
            self._last = now
            self.log(f"{self._name}: {100 * position / self._total:5.1f}% of {self._total / 1e6:,.1f} MB | "
                     f"{docs:,} docs, {tokens:,} tokens | {rates}")

    def finish(self) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self._total)
            self._task = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
