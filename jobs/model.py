"""The job model: rows, the lifecycle, and `set_state`, the one function that changes state.

    queued -> starting -> running -> succeeded | failed | cancelled | lost

A queued job may also go straight to cancelled (cancelled before its runner started), failed
(its runner could not start) or lost; a lost job may be queued again (resume on request).
Terminal states never change otherwise.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from sqlite_utils import Database

from ddtree.jobs.errors import JobStateError
from ddtree.jobs.logfile import create_log
from ddtree.store import jobs as store_jobs
from ddtree.store.db import db_file, logs_dir, transaction
from ddtree.store.redact import redact
from ddtree.store.queries import get_job, now, to_json
from ddtree.store.records import ACTIVE_STATES, JOB_STATES, TERMINAL_STATES, Job

__all__ = [
    "ACTIVE_STATES",
    "JOB_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "create_job",
    "hostname",
    "set_state",
]

TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"starting", "cancelled", "failed", "lost"}),
    "starting": frozenset({"running", "succeeded", "failed", "cancelled", "lost"}),
    "running": frozenset({"succeeded", "failed", "cancelled", "lost"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
    "lost": frozenset({"queued"}),
}

_UNSET: Any = object()

#: A cancelled job's recorded reason ("cancel requested" read as a request still pending).
CANCELLED_REASON = "stopped on request"


def hostname() -> str:
    return socket.gethostname()


def create_job(db: Database, kind: str, spec: dict, *, name: str | None = None) -> int:
    """Write a `queued` row (and its first event); return the job id. The spec must be valid."""
    at = now()
    spec_json = json.dumps(redact(spec), sort_keys=True)  # no secret on disk
    with transaction(db):
        job_id = store_jobs.insert_job(db, kind=kind, name=name, spec_json=spec_json, host=hostname(), at=at)
        # A file of its own, made now: another database in this folder (or this one deleted and
        # made again) has had a job with this id, and its log is not this job's.
        log_path, log = create_log(logs_dir(db_file(db)), f"job-{job_id}")
        log.close()
        store_jobs.set_job_log_path(db, job_id, str(log_path))
        store_jobs.add_job_event(db, job_id, at=at, state="queued", message=f"submitted {kind}")
    return job_id


def set_state(
    db: Database,
    job_id: int,
    state: str,
    message: str | None = None,
    *,
    result: Any = _UNSET,
    error: str | None = None,
) -> Job:
    """Move a job to `state` and record a job_events row, in one transaction.

    Raises JobStateError if the lifecycle does not allow the change (the row is untouched) and
    NotFound for an unknown id. `result` is stored as the job's result JSON; `error` (default:
    `message` when the new state is failed, cancelled or lost) goes to the row's error column.
    """
    if state not in TRANSITIONS:
        raise JobStateError(f"unknown job state {state!r}", f"one of {', '.join(JOB_STATES)}")
    at = now()
    with transaction(db):
        current = get_job(db, job_id)
        if state not in TRANSITIONS[current.state]:
            raise JobStateError(
                f"job {job_id} is {current.state}, it cannot become {state}",
                "it already ended" if current.terminal else None,
            )
        values: dict[str, Any] = {"state": state}
        if state == "starting":
            values["started_at"] = at
        if state in TERMINAL_STATES:
            values["ended_at"] = at
        if state == "queued":
            values.update(ended_at=None, error=None, cancel_requested_at=None, cancel_grace_s=None)
        if error is None and state in ("failed", "cancelled", "lost"):
            error = message
        if error is not None:
            values["error"] = error
        if result is not _UNSET:
            values["result"] = to_json(result)
        store_jobs.update_job(db, job_id, values)
        store_jobs.add_job_event(db, job_id, at=at, state=state, message=message)
        return get_job(db, job_id)
