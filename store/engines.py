"""Rows of the `engines` table: one per engine server a job starts (jobs/engine_process.py writes them).

A row is added `starting` before the process is spawned, gets its pid and log once it runs, becomes
`running` (address, port, ready time) when the server answers, and ends `stopped` or `failed` with
the cause. The supervisor closes rows a dead runner left open (store.queries.close_engines).
"""

from __future__ import annotations

from typing import Any

from sqlite_utils import Database

from ddtree.store.sweeps import write


def add_engine(db: Database, values: dict[str, Any]) -> int:
    """Insert an engine row (the columns of `engines`); its id."""
    with write(db, "the engine row") as tx:
        cur = tx.execute(f"INSERT INTO engines ({', '.join(f'[{k}]' for k in values)}) "
                         f"VALUES ({', '.join('?' for _ in values)})", list(values.values()))
    return int(cur.lastrowid)


def update_engine(db: Database, engine_id: int, **values: Any) -> None:
    """Set these columns of one engine row."""
    if not values:
        return
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with write(db, "the engine row") as tx:
        tx.execute(f"UPDATE engines SET {sets} WHERE id = ?", [*values.values(), engine_id])


def end_engine(db: Database, engine_id: int, state: str, error: str | None, ended_at: float) -> bool:
    """Close a row as `state` unless it is already `failed` (a start's classified cause stays the
    one it shows); an error already there is kept. True when the row changed."""
    with write(db, "the engine row") as tx:
        cur = tx.execute("UPDATE engines SET state = ?, error = coalesce(?, error), ended_at = ? "
                         "WHERE id = ? AND state IS NOT 'failed'", [state, error, ended_at, engine_id])
    return cur.rowcount > 0
