"""The `downloads` table: one row per download job, written by the job and read by its watchers."""

from __future__ import annotations

import json
import os
from typing import Any

from sqlite_utils import Database

from ddtree.store.db import transaction
from ddtree.store.queries import fetch_rows, now
from ddtree.store.records import TERMINAL_STATES


def create_download(db: Database, job_id: int, *, repo_id: str, revision: str | None, include: list[str],
                    local_dir: str | None) -> int:
    """The row of a download that starts `planning`; returns its id."""
    at = now()
    with transaction(db):
        return int(db["downloads"].insert({
            "job_id": job_id, "repo_id": repo_id, "revision": revision, "include": json.dumps(list(include)),
            "local_dir": local_dir, "state": "planning", "created_at": at, "updated_at": at,
        }).last_pk)


def update_download(db: Database, row_id: int, values: dict[str, Any]) -> None:
    """Set columns of the row (the names are ours, never user text) and stamp updated_at."""
    values = {**values, "updated_at": now()}
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with transaction(db):
        db.execute(f"UPDATE downloads SET {sets} WHERE id = ?", [*values.values(), row_id])


#: downloads.state values of a download whose runner may still write; any other state is final.
OPEN_DOWNLOAD_STATES = ("planning", "running", "stalled")


def close_downloads(db: Database, job_id: int, state: str, error: str) -> int:
    """Close the rows of `job_id` still open (their runner is gone, so no one else will): `state`,
    `error` unless one is recorded, no rate or ETA, ended_at now. Returns how many were closed."""
    with transaction(db):
        cur = db.execute(
            "UPDATE downloads SET state = ?, error = coalesce(error, ?), rate_bps = NULL, eta_s = NULL, "
            f"ended_at = ?, updated_at = ? WHERE job_id = ? AND state IN ({', '.join('?' for _ in OPEN_DOWNLOAD_STATES)})",
            [state, error, now(), now(), job_id, *OPEN_DOWNLOAD_STATES],
        )
    return cur.rowcount


def close_downloads_of_ended_jobs(db: Database) -> int:
    """Close the open rows whose job has ended (a runner that exited before its download noticed
    the stop, in versions before the download closed its row at once): the job's state and error.
    Returns how many were closed."""
    open_states = ", ".join("?" for _ in OPEN_DOWNLOAD_STATES)
    ended_states = ", ".join("?" for _ in TERMINAL_STATES)
    with transaction(db):
        cur = db.execute(
            "UPDATE downloads SET state = (SELECT j.state FROM jobs j WHERE j.id = downloads.job_id), "
            "error = coalesce(error, (SELECT j.error FROM jobs j WHERE j.id = downloads.job_id)), "
            f"rate_bps = NULL, eta_s = NULL, ended_at = ?, updated_at = ? WHERE state IN ({open_states}) "
            f"AND job_id IN (SELECT id FROM jobs WHERE state IN ({ended_states}))",
            [now(), now(), *OPEN_DOWNLOAD_STATES, *sorted(TERMINAL_STATES)],
        )
    return cur.rowcount


def open_downloads_of(db: Database, repo_id: str, local_dir: str | None, *, cache_dir: str | None = None,
                      besides: int | None = None) -> list[dict[str, Any]]:
    """The open rows fetching `repo_id` into the same place (a local folder, or for None the HF
    cache `cache_dir`, which only the job's spec records), other than job `besides`'s, whose job
    has not ended (a runner killed outright leaves its row open): files both want wait on
    huggingface_hub's file locks. Places are compared with symlinks resolved: one folder reached
    by two paths is one place."""
    into = "d.local_dir IS NOT NULL" if local_dir is not None else "d.local_dir IS NULL"
    open_states = ", ".join("?" for _ in OPEN_DOWNLOAD_STATES)
    ended_states = ", ".join("?" for _ in TERMINAL_STATES)
    rows = fetch_rows(db, f"SELECT d.*, json_extract(j.spec, '$.cache_dir') AS spec_cache_dir FROM downloads d "
                          f"JOIN jobs j ON j.id = d.job_id WHERE d.repo_id = ? AND {into} AND d.job_id IS NOT ? "
                          f"AND d.state IN ({open_states}) AND j.state NOT IN ({ended_states}) ORDER BY d.id",
                      [repo_id, besides, *OPEN_DOWNLOAD_STATES, *sorted(TERMINAL_STATES)])
    place = _place(local_dir if local_dir is not None else cache_dir)
    same = []
    for row in rows:
        theirs = row.pop("spec_cache_dir")
        if _place(row["local_dir"] if local_dir is not None else theirs) == place:
            same.append(row)
    return same


def _place(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(os.path.expanduser(path))


def recent_downloads(db: Database, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` rows, newest first."""
    return fetch_rows(db, "SELECT * FROM downloads ORDER BY id DESC LIMIT ?", [int(limit)])


def download_of_runner(db: Database, pid: int, since: float) -> dict[str, Any] | None:
    """The newest row made since `since` by a job whose runner is process `pid` (the CLI's
    foreground download runs its job in its own process), or None before there is one."""
    rows = fetch_rows(db, "SELECT d.* FROM downloads d JOIN jobs j ON d.job_id = j.id "
                          "WHERE j.pid = ? AND d.created_at >= ? ORDER BY d.id DESC LIMIT 1", [pid, since])
    return rows[0] if rows else None
