"""Errors raised by the SQLite store.

    StoreError
    ├── DatabasePathError   the path cannot be used (exit 2)
    ├── CorruptDatabase     not SQLite, or damaged; left untouched (exit 2)
    ├── ForeignDatabase     another application's database; left untouched (exit 2)
    ├── NewerDatabase       written by a newer ddtree-console (or its schema altered); untouched (exit 2)
    └── NotFound            no row with that id (exit 2)

One base class to catch (`StoreError`); subclasses name the cause. Every error carries a
one-line message and an optional hint, which the CLI prints as `error: <message> (<hint>)`.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error this package raises on purpose.

    The same shape as ddtree.engine.errors.HintedError, written out again on purpose: the store
    and the engine are independent siblings (pyproject's layers contract), so neither may import
    the other, and a package below both for one 15-line class would be a layer of its own."""

    #: The CLI's exit code for this error: 1 for a failure, 2 for bad input (subclasses set it).
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class DatabasePathError(StoreError):
    """The database path cannot be used (missing permission, a folder, an unwritable place)."""

    exit_code = 2


class CorruptDatabase(StoreError):
    """The file at the database path is not SQLite, or is damaged. It is never overwritten."""

    exit_code = 2


class ForeignDatabase(StoreError):
    """The file is a SQLite database of another application. It is never overwritten."""

    exit_code = 2


class NewerDatabase(StoreError):
    """The schema is past what this version knows: a higher user_version, a migration it has
    never heard of, or a column it needs is gone. Opened read-only in effect: nothing is written."""

    exit_code = 2


class NotFound(StoreError):
    """A row asked for by id does not exist."""

    exit_code = 2
