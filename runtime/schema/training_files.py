"""What the training parser looks at on the file system, and how: an s3:// input is not looked at here, and a
missing file is an error, a warning or nothing by mode (runtime/schema/training.py's `files`)."""
from __future__ import annotations

from typing import Any

from runtime.schema.reader import Report

FILE_MODES = ("error", "warn", "skip")


def is_remote(path: Any) -> bool:
    """An s3:// input is staged inside the job (planned by launcher/staging.py); nothing to look at here."""
    return str(path).startswith("s3://")


class Files:
    """File checks: errors, warnings or nothing, by mode; `prepared` inputs are made by this launch."""

    def __init__(self, report: Report, mode: str, prepared: bool = False):
        assert mode in FILE_MODES, mode
        self.report, self.mode, self.prepared = report, mode, prepared

    @property
    def checked(self) -> bool:
        return self.mode != "skip"

    @property
    def inputs_checked(self) -> bool:
        """The tokenizer and the data, which this launch's data_preparation may be about to make."""
        return self.checked and not self.prepared

    def problem(self, message: str) -> None:
        if self.mode == "error":
            self.report.error(message)
        elif self.mode == "warn":
            self.report.warn(message)
