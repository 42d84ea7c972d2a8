"""The one exception type for user mistakes: the CLI prints each line as `error: ...` and exits 2."""


class UserError(Exception):
    """A mistake the user can fix from the command line or the config. Never raised for our own bugs."""

    def __init__(self, *problems: str):
        assert problems, "a UserError names at least one problem"
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
