"""Subcommands of `ddtree-console`: one module per command, each with
`add_parser(subparsers) -> None` and `run(args) -> int` (see ddtree.console.cli)."""

from __future__ import annotations

import argparse

from ddtree.jobs.errors import JobError

#: SQLite stores integers in 64 signed bits; a larger id cannot name a row and would make the
#: driver raise OverflowError when it binds the value.
MAX_ID = 2**63 - 1


class UsageError(JobError):
    """A command line the command refuses (a missing or contradictory option, something not
    installed); nothing was started. Each command subclasses it to name its own."""

    exit_code = 2


def number(text: str, expected: str, kind: type = int):
    """An argparse type's first step: `text` as an int (or float), else its one-line error
    "expected <expected>, got '<text>'"."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def nonempty_path(text: str) -> str:
    """argparse type of a path option (--db, -o): an empty one is refused, not read as "not given"."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def row_id(text: str, what: str = "run") -> int:
    """An id of a store row (a run, a job): an integer in 1..2**63-1."""
    value = number(text, f"a {what} id (an integer)")
    if value < 1:
        raise argparse.ArgumentTypeError(f"a {what} id is >= 1, got {value}")
    if value > MAX_ID:
        raise argparse.ArgumentTypeError(f"a {what} id is at most {MAX_ID}, got {text}")
    return value


def run_id(text: str) -> int:
    """argparse type for a run id (export, sweep --resume)."""
    return row_id(text, "run")


def job_id(text: str) -> int:
    """argparse type for a job id (jobs show/cancel/logs)."""
    return row_id(text, "job")
