"""The statements of the job tables (jobs, job_events, processes) that ddtree.jobs writes and reads.

The lifecycle itself stays in jobs/model.py (`set_state` is the one state change) and the runner's
protocol in jobs/runner.py and jobs/supervisor.py; this module holds only their SQL.

Two kinds of function, and the difference matters for crash safety:
- `insert_job`, `set_job_log_path`, `update_job` and `add_job_event` are steps of a larger
  write: the caller holds `transaction(db)` around them and whatever else must commit with them
  (set_state reads the row, checks the move, writes the row and its event, all under one lock).
  They refuse to run outside a transaction rather than commit half of it.
- The others are whole writes or plain reads and open their own short transaction where they write.
"""

from __future__ import annotations

import json
from typing import Any

from sqlite_utils import Database

from ddtree.store.db import transaction
from ddtree.store.errors import StoreError
from ddtree.store.queries import insert_row, now, update_row


def _in_transaction(db: Database, what: str) -> None:
    if not db.conn.in_transaction:
        raise StoreError(f"{what} must run inside transaction(db)", "it is one step of a larger write")


# -- steps of a caller's transaction --------------------------------------------------------------

def insert_job(db: Database, *, kind: str, name: str | None, spec_json: str, host: str, at: float) -> int:
    """A `queued` jobs row; returns its id."""
    _in_transaction(db, "insert_job")
    cur = db.execute(
        "INSERT INTO jobs (kind, name, state, spec, host, created_at) VALUES (?, ?, 'queued', ?, ?, ?)",
        [kind, name, spec_json, host, at],
    )
    return int(cur.lastrowid)


def set_job_log_path(db: Database, job_id: int, log_path: str) -> None:
    _in_transaction(db, "set_job_log_path")
    db.execute("UPDATE jobs SET log_path = ? WHERE id = ?", [log_path, job_id])


def update_job(db: Database, job_id: int, values: dict[str, Any]) -> None:
    """Set columns of one jobs row (the column names are ours, never user text)."""
    _in_transaction(db, "update_job")
    sets = ", ".join(f"[{c}] = ?" for c in values)
    db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*values.values(), job_id])


def add_job_event(db: Database, job_id: int, *, at: float, state: str, message: str | None) -> None:
    _in_transaction(db, "add_job_event")
    db.execute("INSERT INTO job_events (job_id, at, state, message) VALUES (?, ?, ?, ?)",
               [job_id, at, state, message])


# -- whole writes -----------------------------------------------------------------------------------

def record_runner(db: Database, job_id: int, *, pid: int, pgid: int | None, pid_started: float | None,
                  host: str) -> None:
    """The runner that took the job: its pid (and group, when detached) and a first heartbeat."""
    with transaction(db):
        db.execute(
            "UPDATE jobs SET pid = ?, pgid = ?, pid_started = ?, host = ?, heartbeat_at = ? WHERE id = ?",
            [pid, pgid, pid_started, host, now(), job_id],
        )


def record_heartbeat(db: Database, job_id: int) -> None:
    with transaction(db):
        db.execute("UPDATE jobs SET heartbeat_at = ? WHERE id = ?", [now(), job_id])


def request_cancel(db: Database, job_id: int, grace_s: float) -> None:
    """Mark the job for cancelling; its runner's heartbeat sees it on any host."""
    with transaction(db):
        db.execute("UPDATE jobs SET cancel_requested_at = ?, cancel_grace_s = ? WHERE id = ?",
                   [now(), float(grace_s), job_id])


def set_progress(db: Database, job_id: int, *, progress_done: float | None = None,
                 progress_total: float | None = None, progress_message: str | None = None) -> None:
    """The job's progress columns; those left None keep their value."""
    values = {k: v for k, v in (("progress_done", progress_done), ("progress_total", progress_total),
                                ("progress_message", progress_message)) if v is not None}
    if values:
        update_row(db, "jobs", job_id, values)


def add_process(db: Database, job_id: int, *, name: str, argv: list[str], pid: int, pid_started: float | None,
                log_path: str) -> int:
    """A processes row for a child the job just started (a group leader: pgid = pid); its id."""
    return insert_row(db, "processes", {
        "job_id": job_id, "name": name, "argv": json.dumps(argv), "pid": pid, "pgid": pid,
        "pid_started": pid_started, "log_path": log_path, "started_at": now()})


def end_process(db: Database, process_id: int, returncode: int | None) -> None:
    """The child exited (or was reaped) with `returncode`."""
    update_row(db, "processes", process_id, {"ended_at": now(), "returncode": returncode})


def close_process(db: Database, process_id: int) -> None:
    """ended_at now on a processes row still open (one already closed keeps its time)."""
    with transaction(db):
        db.execute("UPDATE processes SET ended_at = ? WHERE id = ? AND ended_at IS NULL", [now(), process_id])


# -- reads ------------------------------------------------------------------------------------------

def cancel_request(db: Database, job_id: int) -> tuple[float, float | None] | None:
    """(cancel_requested_at, cancel_grace_s) once a cancel was requested, else None."""
    row = db.execute("SELECT cancel_requested_at, cancel_grace_s FROM jobs WHERE id = ?", [job_id]).fetchone()
    return (row[0], row[1]) if row and row[0] is not None else None


def cancel_grace(db: Database, job_id: int) -> float | None:
    """The grace the canceller gave, or None (no cancel, or one without a grace)."""
    row = db.execute("SELECT cancel_grace_s FROM jobs WHERE id = ?", [job_id]).fetchone()
    return None if not row or row[0] is None else float(row[0])
