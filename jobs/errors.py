"""Errors raised by jobs, recipes, sweeps.

One base class to catch (`JobError`); subclasses name the cause. Every error carries a
one-line message and an optional hint, which the CLI prints as `error: <message> (<hint>)`.
"""

from __future__ import annotations


class JobError(Exception):
    """Base of every error this package raises on purpose."""

    #: The CLI's exit code for this error: 1 for a failure, 2 for bad input (subclasses set it).
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message
