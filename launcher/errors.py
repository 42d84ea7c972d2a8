"""The one exception type for user mistakes: the CLI prints each line as `error: ...` and exits 2. And the one way a
dry run says what it rendered without checking: `not checked: ...` lines."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix from the command line or the config. Never raised for our own bugs."""

    def __init__(self, *problems: str):
        assert problems, "a UserError names at least one problem"
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def print_not_checked(notes: list[str] | tuple[str, ...]) -> None:
    """What a dry run rendered without checking (the cluster's state, files a data preparation or a real run makes
    first): one `not checked: ...` line each on stderr, so that a dry run that renders is not read as one that
    checked them. A real run checks them, or refuses with a UserError."""
    import click

    for note in notes:
        click.echo(f"not checked: {note}", err=True)
