"""Jobs: the job model, the supervisor and the detached runner.

    submit(db_path, kind, spec, *, name=None, detach=True) -> int
    cancel(db_path, job_id, grace_s=10.0) -> Job
    reconcile(db_path, stale_s=15.0) -> list[int]
    wait(db_path, job_id, timeout=None) -> Job
    set_state(db, job_id, state, message=None, *, result=..., error=None) -> Job
    JobContext (ddtree.jobs.context)

The names resolve lazily, so importing a submodule (ddtree.jobs.errors, .recipe) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "submit": "ddtree.jobs.supervisor",
    "cancel": "ddtree.jobs.supervisor",
    "reconcile": "ddtree.jobs.supervisor",
    "wait": "ddtree.jobs.supervisor",
    "set_state": "ddtree.jobs.model",
    "create_job": "ddtree.jobs.model",
    "JobContext": "ddtree.jobs.context",
    "JobError": "ddtree.jobs.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
