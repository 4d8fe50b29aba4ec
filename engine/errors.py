"""Errors raised by engines, hardware, models.

One base class to catch (`EngineError`); subclasses name the cause. Every error carries a
one-line message and an optional hint, which the CLI prints as `error: <message> (<hint>)`.

`HintedError` is that shape (message, hint, exit code) on its own, so the packages above the
engine reuse it for their bases (jobs' `JobError`). The store, the engine's sibling, may not
import it and keeps its own copy (store/errors.py says why).
"""

from __future__ import annotations


class HintedError(Exception):
    """A one-line message with an optional hint, and the CLI's exit code for it. Not raised on
    its own: each package catches and raises its own base (EngineError, JobError)."""

    #: The CLI's exit code for this error: 1 for a failure, 2 for bad input (subclasses set it).
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class EngineError(HintedError):
    """Base of every error this package raises on purpose."""
