"""Errors raised by jobs, recipes, sweeps.

    JobError
    ├── BadSpec            a job spec is invalid (exit 2)
    │   └── UnknownKind    no such job kind (exit 2)
    ├── JobStateError      a state change the lifecycle forbids (exit 2)
    ├── JobCancelled       raised inside a job by ctx.check_cancelled()
    └── RunnerStartError   the detached runner did not start

One base class to catch (`JobError`), not an EngineError; subclasses name the cause. Every error
has the engine's HintedError shape: a one-line message and an optional hint, which the CLI prints
as `error: <message> (<hint>)`.
"""

from __future__ import annotations

from ddtree.engine.errors import HintedError


class JobError(HintedError):
    """Base of every error this package raises on purpose."""


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
