"""Errors raised by jobs, recipes, sweeps.

    JobError
    ├── BadSpec            a job spec is invalid (exit 2)
    │   └── UnknownKind    no such job kind (exit 2)
    ├── JobStateError      a state change the lifecycle forbids (exit 2)
    ├── JobCancelled       raised inside a job by ctx.check_cancelled()
    └── RunnerStartError   the detached runner did not start

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


class BadSpec(JobError):
    """A job spec (or kind name) is not valid; nothing was started."""

    exit_code = 2


class UnknownKind(BadSpec):
    """No module ddtree.jobs.kinds.<kind>."""


class JobStateError(JobError):
    """A state change the lifecycle does not allow (e.g. cancelling a finished job)."""

    exit_code = 2


class JobCancelled(JobError):
    """Raised inside a running job by `ctx.check_cancelled()` once a cancel was requested."""


class RunnerStartError(JobError):
    """The detached runner could not be started."""
