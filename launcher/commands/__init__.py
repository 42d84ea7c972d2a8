"""Subcommands beyond a launch, each a click `command` imported when it is invoked (launcher/cli.py)."""

from __future__ import annotations

import math
import shlex
import sys

import click


def command_line(ctx: click.Context) -> str:
    """The command as typed (recorded in every script and launch record): run()'s argv, not this process's."""
    argv = (ctx.find_root().obj or {}).get("argv", sys.argv[1:])
    return "nxdt-launch " + shlex.join(argv)


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan compares false with every bound, so FloatRange lets it
    through, and 1e400 reads as inf), and says what it wants in words: `-5 must be a positive number of seconds`."""

    def __init__(self, *args, unit: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.unit = f" of {unit}" if unit else ""

    def convert(self, value, param, ctx):
        try:
            number = super().convert(value, param, ctx)
        except click.BadParameter:  # not a number, or outside the range: one message for both
            number = math.nan
        if not math.isfinite(number):
            self.fail(f"{value} must be {self._wanted()}", param, ctx)
        return number

    def _wanted(self) -> str:
        low, high = self.min, self.max
        if low == 0 and self.min_open and high is None:
            return f"a positive number{self.unit}"
        if high is None:
            return f"a number{self.unit} {'>' if self.min_open else '>='} {low:g}"
        return f"a number{self.unit} from {low:g} to {high:g}"
